"""Tool-call parsers: one per family, complete calls and partial/unterminated ones."""

from __future__ import annotations

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


def test_parser_for() -> None:
    assert isinstance(parser_for(), HermesParser)
    assert isinstance(parser_for(chat_template="{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert isinstance(parser_for("harmony"), HarmonyParser)
