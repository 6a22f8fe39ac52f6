"""gpt-oss harmony held to its real chat template (issue 35: a call in the form the template writes
past calls, recipient in the role header, was not parsed, and analysis text leaked into content)."""

from __future__ import annotations

import pytest
from real_templates import model_with_template
from serve_harness import TOOLS

from freetoken_agents import FreeTokenModel, GenerateRequest
from freetoken_agents.parsers import HarmonyParser

pytestmark = pytest.mark.usefixtures("one_thread")

ASK = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture
def model() -> FreeTokenModel:
    return model_with_template("openai-gpt-oss-120b")  # the family guessed from the template


def rendered_call(model: FreeTokenModel, thinking: str = "") -> str:
    function = {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    message = {"role": "assistant", "content": "", "tool_calls": [{"id": "abcDEF123", "function": function}]}
    if thinking:
        message["thinking"] = thinking
    history = [*ASK, message, {"role": "tool", "tool_call_id": "abcDEF123", "content": "42"}]
    return model.tokenizer.decode(model.render(history, TOOLS))


def test_a_past_call_as_the_template_writes_it_parses_back(model):
    assert isinstance(model.parser, HarmonyParser)
    text = rendered_call(model, thinking="Multiply them.")
    assert "<|start|>assistant to=functions.multiply<|channel|>commentary" in text  # the header form
    reply = text[text.index("<|start|>assistant<|channel|>analysis") :]
    parsed = model.parser.parse(reply)
    [call] = parsed.calls
    assert (call.name, call.arguments, call.error) == ("multiply", {"a": 6, "b": 7}, None)
    assert "Multiply them." not in parsed.content and "analysis" not in parsed.content
    assert model.parser.call_started(reply) == reply.index("to=functions.multiply")


def test_a_forced_call_parses_and_the_next_turn_renders(model):
    model.sync(model.render(ASK, TOOLS))
    request = GenerateRequest(tools=TOOLS, force="multiply", max_call_tokens=48, temperature=0)
    text = "".join(e.text for e in model.generate(request) if e.kind == "text")
    [call] = model.parser.parse(text).calls
    assert call.error is None and call.name == "multiply"
    function = {"name": call.name, "arguments": call.arguments}
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"id": "abcDEF123", "function": function}]},
    ]
    history.append({"role": "tool", "tool_call_id": "abcDEF123", "content": "42"})
    again = model.tokenizer.decode(model.render(history, TOOLS))  # the template accepts our call back
    [back] = model.parser.parse(again[again.rindex("<|start|>assistant to=") :]).calls
    assert (back.name, back.arguments) == (call.name, call.arguments)


def split_turn(model: FreeTokenModel, prefix: str) -> tuple[str, str]:
    model.sync(model.render(ASK, None))
    events = list(model.generate(GenerateRequest(prefix=prefix, max_new_tokens=2, temperature=0)))
    text = "".join(e.text for e in events if e.kind == "text")
    return "".join(e.text for e in events if e.kind == "reasoning"), text


def test_the_analysis_channel_is_reasoning_and_the_final_channel_the_answer(model):
    # what gpt-oss writes after the template's generation prompt `<|start|>assistant`; the old
    # decoder returned all of it, headers included, as the answer
    prefix = "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>Five"
    reasoning, text = split_turn(model, prefix)
    assert reasoning == "Add them." and text.startswith("Five") and "<|" not in text


def test_a_final_channel_without_analysis_loses_only_its_header(model):
    reasoning, text = split_turn(model, "<|channel|>final<|message|>Five")
    assert reasoning == "" and text.startswith("Five") and "<|" not in text


WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}


@pytest.mark.parametrize("thinking", ["", "Look it up."])
def test_the_templates_own_rendering_of_a_call_parses_back(model, thinking):
    calls = [{"id": "abcDEF123", "function": WEATHER_CALL}]
    message = {"role": "assistant", "content": "", "tool_calls": calls}
    if thinking:
        message["thinking"] = thinking
    history = [{"role": "user", "content": "Weather in Paris?"}, message]
    history.append({"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"})
    text = model.tokenizer.decode(model.render(history, TOOLS))
    start = text.index("<|start|>assistant", text.index("Weather in Paris?"))
    reply = text[start : text.index("<|call|>", start) + len("<|call|>")]
    for turn in (reply, reply.removesuffix("<|call|>")):  # `<|call|>` as written, or as a stop token
        parsed = model.parser.parse(turn)
        assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
            (WEATHER_CALL["name"], WEATHER_CALL["arguments"], None)
        ]
        assert (parsed.partial, parsed.content) == (None, "")  # the analysis text is no content


@pytest.mark.parametrize(
    "call",
    [
        '<|channel|>commentary to=functions.multiply <|constrain|>json<|message|>{"a": 6, "b": 7}<|call|>',
        ' to=functions.multiply<|channel|>commentary json<|message|>{"a": 6, "b": 7}<|call|>',
    ],
)
def test_an_unconstrained_call_is_anchored_once(model, call):
    # The call's marker was found again for every token after it: one anchor, and one replay of the
    # call's tokens, per token (the trace recorded a dozen tool-call anchors for one call).
    model.sync(model.render(ASK, TOOLS))
    request = GenerateRequest(tools=TOOLS, prefix=call, constrain=False, max_new_tokens=1, temperature=0)
    events = list(model.generate(request))
    assert [e.anchor.kind for e in events if e.kind == "anchor"] == ["tool_call"]
    text = "".join(e.text for e in events if e.kind == "text")
    [parsed] = model.parser.parse(text[: text.index("<|call|>") + len("<|call|>")]).calls
    assert (parsed.name, parsed.arguments) == ("multiply", {"a": 6, "b": 7})
