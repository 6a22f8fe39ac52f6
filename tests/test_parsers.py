"""Tool-call parsers: one per family, complete calls and partial/unterminated ones."""

from __future__ import annotations

import pytest

from freetoken_agents.parsers import (
    DeepSeekParser,
    HarmonyParser,
    HermesParser,
    MistralParser,
    parser_for,
)
from freetoken_agents.parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP


def test_hermes() -> None:
    p = HermesParser()
    r = p.parse(
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert r.content == "Sure." and [(c.name, c.arguments) for c in r.calls] == [
        ("f", {"x": 1}),
        ("g", {"y": 2}),
    ]
    assert r.partial is None
    partial = p.parse('<tool_call>\n{"name": "f", "argu')
    assert partial.calls == [] and partial.partial.startswith("<tool_call>")
    bad = p.parse("<tool_call>{not json}</tool_call>")
    assert bad.malformed and bad.calls[0].error
    assert p.held_back("text <tool_") == len("<tool_")


def test_mistral() -> None:
    p = MistralParser()
    r = p.parse('ok[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]')
    assert r.content == "ok" and r.calls[0].arguments == {"x": 1}
    assert p.parse('[TOOL_CALLS][{"name": "f", "argum').partial is not None


def test_deepseek() -> None:
    p = DeepSeekParser()
    call = f'{CALL_BEGIN}function{SEP}get\n```json\n{{"a": 1}}\n```{CALL_END}'
    r = p.parse(f"hi{CALLS_BEGIN}{call}{CALLS_END}")
    assert r.content == "hi" and (r.calls[0].name, r.calls[0].arguments) == ("get", {"a": 1})
    assert p.parse(f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get\n```json\n{{").partial is not None


def test_harmony() -> None:
    p = HarmonyParser()
    r = p.parse('<|channel|>commentary to=functions.get <|constrain|>json<|message|>{"a": 1}<|call|>')
    assert (r.calls[0].name, r.calls[0].arguments) == ("get", {"a": 1})
    assert p.parse('<|channel|>commentary to=functions.get <|message|>{"a"').partial is not None
    final = p.parse("<|channel|>final<|message|>The answer.<|return|>")
    assert final.content == "The answer." and final.calls == []


WEATHER = '{"city": "Paris", "days": 3}'
HARMONY_CALLS = [
    f" to=functions.get_weather<|channel|>commentary json<|message|>{WEATHER}<|call|>",  # the template's
    f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>",
    f"<|channel|>commentary to=functions.get_weather json<|message|>{WEATHER}<|call|>",  # no constrain
]


@pytest.mark.parametrize("call", HARMONY_CALLS)
@pytest.mark.parametrize("start", ["", "<|start|>assistant"])
@pytest.mark.parametrize("stopped", [False, True], ids=["ended", "stopped"])
def test_harmony_calls_in_both_forms_parse(call: str, start: str, stopped: bool) -> None:
    # "stopped": `<|call|>` is a gpt-oss end-of-turn token; a decoder that stops on it drops it
    text = start + (call.removesuffix("<|call|>") if stopped else call)
    r = HarmonyParser().parse(text)
    assert [(c.name, c.arguments, c.error) for c in r.calls] == [
        ("get_weather", {"city": "Paris", "days": 3}, None)
    ]
    assert (r.partial, r.content) == (None, "")
    assert r.calls[0].offset == text.index("to=" if call.startswith(" ") else "<|channel|>")


@pytest.mark.parametrize("body", ['{"city": "Par', '{"city": "Paris", "days"', "[1, 2]", ""])
def test_a_harmony_call_cut_short_stays_unterminated(body: str) -> None:
    for call in HARMONY_CALLS:
        text = "Checking." + call.removesuffix(f"{WEATHER}<|call|>") + body
        r = HarmonyParser().parse(text)
        assert r.calls == [] and r.partial == text[r.partial_offset :] and r.content == "Checking."


@pytest.mark.parametrize("head", ["<|channel|>commentary to=functions.", "<|start|>assistant to=functions."])
def test_harmony_call_started_counts_only_a_marker_ending_after_since(head: str) -> None:
    # a streamer passes the length it searched: a marker found before is not found again
    p, start = HarmonyParser(), head.index("<|channel|>" if "commentary" in head else "to=")
    assert p.call_started(head, len(head) - 1) == start  # its last character is new
    assert p.call_started(head, len(head)) is None
    assert p.call_started(head + "get_weather", len(head) + 5) is None


def test_parser_for() -> None:
    assert isinstance(parser_for(), HermesParser)
    assert isinstance(parser_for(chat_template="{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert isinstance(parser_for("harmony"), HarmonyParser)
