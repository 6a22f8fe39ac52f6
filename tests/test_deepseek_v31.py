"""DeepSeek-V3.1's call format, held to its real chat template (issue 35: the template writes
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}` but we parsed only V3's
`function<｜tool▁sep｜>NAME` + fenced JSON, and wrote V3's form). What the template writes for a
past call, the parser reads; what the decoder writes is in the template's form."""

from __future__ import annotations

import pytest
from real_templates import model_with_template
from serve_harness import TOOLS

from freetoken_agents import FreeTokenModel, GenerateRequest
from freetoken_agents.parsers import DeepSeekParser, DeepSeekV31Parser, parser_for
from freetoken_agents.parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

pytestmark = pytest.mark.usefixtures("one_thread")

V31 = "deepseek-ai-DeepSeek-V3.1"
ASK = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture
def model() -> FreeTokenModel:
    return model_with_template(V31)  # the family guessed from the template


def test_the_v31_template_gets_the_v31_parser(model):
    assert isinstance(model.parser, DeepSeekV31Parser)
    assert (
        type(parser_for(chat_template=f"... '{CALLS_BEGIN}{CALL_BEGIN}function{SEP}' ...")) is DeepSeekParser
    )


def test_a_past_call_as_the_template_writes_it_parses_back(model):
    call = {
        "id": "abcDEF123",
        "type": "function",
        "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}},
    }
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = model.tokenizer.decode(model.render(history, TOOLS, generation_prompt=False))
    assert f"{CALL_BEGIN}multiply{SEP}" in text  # the V3.1 form
    [parsed] = model.parser.parse(text[text.index(CALLS_BEGIN) :]).calls
    assert parsed.error is None and parsed.name == "multiply" and parsed.arguments == {"a": 6, "b": 7}


def test_a_forced_call_is_written_in_the_templates_form(model):
    model.sync(model.render(ASK, TOOLS))
    request = GenerateRequest(tools=TOOLS, force="multiply", max_call_tokens=48, temperature=0)
    text = "".join(e.text for e in model.generate(request) if e.kind == "text")
    assert text.startswith(f"{CALLS_BEGIN}{CALL_BEGIN}multiply{SEP}{{") and text.endswith(
        f"}}{CALL_END}{CALLS_END}"
    )
    [call] = model.parser.parse(text).calls
    assert call.error is None and call.name == "multiply" and set(call.arguments) == {"a", "b"}


def test_either_form_is_parsed_by_either_parser():
    v3 = f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}add\n```json\n{{"a": 1}}\n```{CALL_END}{CALLS_END}'
    v31 = f'{CALLS_BEGIN}{CALL_BEGIN}add{SEP}{{"a": 1}}{CALL_END}{CALLS_END}'
    for parser in (DeepSeekParser(), DeepSeekV31Parser()):
        for text in (v3, v31):
            [call] = parser.parse(text).calls
            assert (call.name, call.arguments, call.error) == ("add", {"a": 1}, None)
