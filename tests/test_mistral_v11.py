"""Mistral v11 (Small 3.2) held to its real chat template (issue 35: its
`[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{json}` format was neither parsed nor produced)."""

from __future__ import annotations

import pytest
from real_templates import model_with_template, real_template
from serve_harness import TOOLS

from freetoken_agents import FreeTokenModel, GenerateRequest
from freetoken_agents.parsers import MistralParser, MistralV11Parser, parser_for

pytestmark = pytest.mark.usefixtures("one_thread")

ASK = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture
def model() -> FreeTokenModel:
    return model_with_template("Mistral-Small-3.2-24B-Instruct-2506")  # the family guessed from the template


def test_the_template_picks_the_parser(model):
    assert isinstance(model.parser, MistralV11Parser)
    nemo = real_template("mistralai-Mistral-Nemo-Instruct-2407")
    assert type(parser_for(chat_template=nemo)) is MistralParser


def test_past_calls_as_the_template_writes_them_parse_back(model):
    calls = [
        {"id": "abcDEF123", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}},
        {"id": "xyzXYZ789", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
    ]
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": calls}]
    text = model.tokenizer.decode(model.render(history, TOOLS, generation_prompt=False))
    assert "[TOOL_CALLS]multiply[CALL_ID]abcDEF123[ARGS]" in text
    parsed = model.parser.parse(text[text.index("[TOOL_CALLS]") :])
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        ("multiply", {"a": 6, "b": 7}, None),
        ("add", {"a": 1, "b": 2}, None),
    ]


def test_a_forced_call_is_written_in_the_templates_form_and_renders_back(model):
    model.sync(model.render(ASK, TOOLS))
    request = GenerateRequest(tools=TOOLS, force="multiply", max_call_tokens=48, temperature=0)
    text = "".join(e.text for e in model.generate(request) if e.kind == "text")
    assert text.startswith("[TOOL_CALLS]multiply[ARGS]{")
    [call] = model.parser.parse(text).calls
    assert call.error is None and set(call.arguments) == {"a", "b"}
    function = {"name": call.name, "arguments": call.arguments}
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", "function": function}]},
    ]
    history.append({"role": "tool", "tool_call_id": "call_1_0", "content": "42"})
    model.render(history, TOOLS)  # the template's own checks pass (call ids included)


def test_an_unfinished_call_is_partial():
    parsed = MistralV11Parser().parse('Sure.[TOOL_CALLS]add[ARGS]{"a": ')
    assert (
        parsed.calls == [] and parsed.partial == '[TOOL_CALLS]add[ARGS]{"a": ' and parsed.content == "Sure."
    )
