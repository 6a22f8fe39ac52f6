"""Qwen3-Coder's XML calls held to its real chat template (issue 35: the template writes
`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`,
but its family was taken for Hermes: calls were read, and forced calls written, as
`<tool_call>{json}</tool_call>`). The parser reads the template's form with values typed by the
tools' schemas; forced calls come out in it through the SDK, the Agent, ChatFreeToken and the
server; what we parse renders back through the template as transformers renders it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
from real_templates import model_with_template, real_template
from real_tokenizers import real_tokenizer
from serve_harness import MODEL, TOOLS, first_difference, running_server, shared_engine
from tiny_models import make_tiny_tokenizer

from freetoken_agents import Agent, FreeTokenModel, GenerateRequest, default_model
from freetoken_agents.constrained import ConstrainedDecode, GrammarFactory
from freetoken_agents.engine import Engine, SamplingParams
from freetoken_agents.engine.runtime.generate import Sampler
from freetoken_agents.parsers import HermesParser, Qwen3CoderParser, parser_for
from freetoken_agents.recipes.tiny.world import multiply
from freetoken_agents.testing import ScriptedModel, ToolCall

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = "Qwen3-Coder"
ASK = [{"role": "user", "content": "What is 6 times 7?"}]
NAMES = [t["function"]["name"] for t in TOOLS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
EDIT = {
    "type": "function",
    "function": {
        "name": "edit_file",
        "description": "Replace a line of a file.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "line": {"type": "integer"},
                "scale": {"type": "number"},
                "dry_run": {"type": "boolean"},
                "options": {"type": "object", "properties": {"indent": {"type": "integer"}}},
                "tags": {"type": "array", "items": {"type": "string"}},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "text": {"type": "string"},
            },
            "required": ["path", "line", "text"],
        },
    },
}
# a call as the template writes one: strings raw (a number-like one, a multi-line one), the
# rest through `tojson` (objects, lists) or Jinja's `string` filter (True, None, 1.5)
CALL_TEXT = (
    "<tool_call>\n<function=edit_file>\n"
    "<parameter=path>\n42\n</parameter>\n"
    "<parameter=line>\n7\n</parameter>\n"
    "<parameter=scale>\n1.5\n</parameter>\n"
    "<parameter=dry_run>\nTrue\n</parameter>\n"
    '<parameter=options>\n{"indent": 4}\n</parameter>\n'
    '<parameter=tags>\n["a", "b c"]\n</parameter>\n'
    "<parameter=note>\nNone\n</parameter>\n"
    '<parameter=text>\n    if x:\n        return {"ok": true}\n</parameter>\n'
    "</function>\n</tool_call>"
)
CALL_ARGS = {
    "path": "42",
    "line": 7,
    "scale": 1.5,
    "dry_run": True,
    "options": {"indent": 4},
    "tags": ["a", "b c"],
    "note": None,
    "text": '    if x:\n        return {"ok": true}',
}


@pytest.fixture
def model() -> FreeTokenModel:
    return model_with_template(TEMPLATE)  # the family guessed from the template


TYPED = [*TOOLS, EDIT]  # the tools a request offered: they type the values parse reads


def typed_parse(text: str):
    return Qwen3CoderParser().parse(text, TYPED)


# ---- the parser ------------------------------------------------------------------------------------
def test_values_are_typed_by_the_tools_schema():
    [call] = typed_parse(CALL_TEXT).calls
    assert (call.name, call.error, call.arguments) == ("edit_file", None, CALL_ARGS)
    # JSON's spellings too (what the grammar writes)
    json_spelled = CALL_TEXT.replace("True", "false").replace("None", "null")
    [call] = typed_parse(json_spelled).calls
    assert (call.arguments["dry_run"], call.arguments["note"], call.arguments["path"]) == (False, None, "42")
    # a tool whose schema is unknown: each value is JSON where it parses, else the text
    [untyped] = typed_parse(json_spelled.replace("edit_file", "unknown_tool")).calls
    assert untyped.arguments == {**CALL_ARGS, "path": 42, "dry_run": False}


def test_several_calls_in_one_turn_and_the_text_around_them():
    text = (
        "Let me compute both.\n<tool_call>\n<function=multiply>\n<parameter=a>\n6\n</parameter>\n"
        "<parameter=b>\n7\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nSão Paulo\n</parameter>\n</function>\n</tool_call>"
    )
    parsed = typed_parse(text)
    assert parsed.content == "Let me compute both." and parsed.partial is None
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        ("multiply", {"a": 6, "b": 7}, None),
        ("get_weather", {"city": "São Paulo"}, None),
    ]
    assert parsed.calls[1].offset == text.rindex("<tool_call>")


@pytest.mark.parametrize(
    "body",
    [
        "multiply\n<parameter=a>\n6\n</parameter>\n</function>",  # no <function=
        "<function=multiply>\n<parameter=a>\n6\n</function>",  # an unclosed parameter
        "<function=multiply>\n<parameter=a>\n6\n</parameter>\nb=7\n</function>",  # stray text
        "<function=multiply>\n<parameter=a>\n6\n</parameter>\n",  # no </function>
        "<function=multiply>\n<parameter=a>\n6\n</parameter>\n<parameter=a>\n7\n</parameter>\n</function>",
    ],
)
def test_malformed_xml_is_an_error(body):
    [call] = typed_parse(f"<tool_call>\n{body}\n</tool_call>").calls
    assert call.error and isinstance(call.arguments, str)


def test_an_unfinished_call_is_partial():
    parsed = typed_parse("Sure.\n<tool_call>\n<function=multiply>\n<parameter=a>\n6")
    assert parsed.calls == [] and parsed.content == "Sure." and parsed.partial.startswith("<tool_call>")


def test_values_are_typed_by_the_tools_of_the_request_being_parsed():
    # Two requests offer a tool of the same name with different parameter types. The first design
    # kept the schemas of the last prompt rendered on a parser shared by every context, so one
    # request's call was typed by the other's schema.
    as_text = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
    as_number = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"key": {"type": "integer"}}},
        },
    }
    text = "<tool_call>\n<function=lookup>\n<parameter=key>\n007\n</parameter>\n</function>\n</tool_call>"
    parser = Qwen3CoderParser()
    assert parser.parse(text, [as_text]).calls[0].arguments == {"key": "007"}
    assert parser.parse(text.replace("007", "7"), [as_number]).calls[0].arguments == {"key": 7}
    assert parser.parse(text, [as_text]).calls[0].arguments == {"key": "007"}


def test_a_scripted_call_with_arguments_is_written_in_xml():
    # ScriptedModel wrote `<tool_call>{"name": ..., "arguments": ...}</tool_call>` for every
    # family, which this family's parser reads as malformed
    model = ScriptedModel([ToolCall("multiply", {"a": 6, "b": 7}), "42"], family="qwen3_coder")
    result = Agent(model, [multiply]).run("What is 6 times 7?")
    assert result.trace.retries == []
    assert [(c.tool, c.arguments, c.result) for c in result.trace.tool_calls] == [
        ("multiply", {"a": 6, "b": 7}, 42)
    ]


def test_a_malformed_call_drives_the_agents_retry():
    broken = ToolCall("multiply", raw="<parameter=a>\n6\n</function>")
    fixed = ToolCall(
        "multiply", raw="<parameter=a>\n6\n</parameter>\n<parameter=b>\n7\n</parameter>\n</function>"
    )
    model = ScriptedModel([broken, fixed, "42"], family="qwen3_coder", chunk=3)
    result = Agent(model, [multiply]).run("What is 6 times 7?")
    assert [a.error_type for a in result.trace.retries] == ["ToolCallMalformed"]
    assert [(c.tool, c.arguments, c.result) for c in result.trace.tool_calls] == [
        ("multiply", {"a": 6, "b": 7}, 42)
    ]


def test_a_call_split_across_chunks_is_detected_where_it_starts():
    parser, text = Qwen3CoderParser(), "Sure. " + CALL_TEXT
    seen, searched, found = "", 0, None
    for i in range(0, len(text), 4):  # streamed four characters at a time: the marker is split
        seen += text[i : i + 4]
        if found is None:
            assert parser.held_back(seen) == 0 or "<tool_call>".startswith(seen[-parser.held_back(seen) :])
            found = parser.call_started(seen, searched)
            searched = len(seen)
    assert found == len("Sure. ")
    assert parser.parse(seen, TYPED).calls[0].arguments == CALL_ARGS


# ---- family detection ------------------------------------------------------------------------------------
def test_the_template_gets_the_qwen3_coder_parser(model):
    assert isinstance(model.parser, Qwen3CoderParser) and model.parser.family == "qwen3_coder"
    for hermes in ("Qwen-Qwen3-0.6B", "Qwen-Qwen2.5-7B-Instruct"):  # JSON in <tool_call>: unchanged
        assert type(parser_for(chat_template=real_template(hermes))) is HermesParser
    assert type(parser_for("qwen3_coder")) is Qwen3CoderParser


# ---- what we parse renders back as transformers renders it ----------------------------------------------
def test_a_parsed_call_renders_back_token_for_token():
    tokenizer = real_tokenizer("qwen3")
    tokenizer.chat_template = real_template(TEMPLATE)
    engine = Engine.from_pretrained(shared_engine().source)
    engine._tokenizer = tokenizer  # rendering reads the tokenizer only; the weights never run
    [call] = typed_parse(CALL_TEXT).calls
    function = {"name": call.name, "arguments": call.arguments}
    messages = [
        {"role": "system", "content": "You are a careful coder."},
        {"role": "user", "content": "Fix line 7."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "abcDEF123", "function": function}]},
        {"role": "tool", "tool_call_id": "abcDEF123", "name": call.name, "content": "done"},
    ]
    tools = [*TOOLS, EDIT]
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    expected = [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]
    model = FreeTokenModel(engine)
    try:
        ids = model.render(messages, tools)
    finally:
        model.close()
    assert ids == expected
    assert CALL_TEXT in tokenizer.decode(ids)  # the template writes back the very text we parsed
    assert Qwen3CoderParser().format_call(call.name, call.arguments) == CALL_TEXT


# ---- calls written by the constrained decoder --------------------------------------------------------
def generated(model: FreeTokenModel, request: GenerateRequest) -> str:
    model.reset()
    model.sync(model.render(ASK, TOOLS))
    return "".join(e.text for e in model.generate(request) if e.kind == "text")


def assert_schema_valid_xml_call(parser: Qwen3CoderParser, text: str, names: list[str]) -> Any:
    [call] = parser.parse(text, TYPED).calls
    assert call.error is None and call.name in names, text
    assert text.startswith(f"<tool_call>\n<function={call.name}>\n<parameter=") and text.endswith(
        "\n</parameter>\n</function>\n</tool_call>"
    )
    jsonschema.validate(call.arguments, SCHEMAS[call.name])
    return call


@pytest.mark.parametrize("force", ["multiply", "get_weather", "*"])
def test_a_forced_call_is_written_in_the_templates_form(model, force):
    text = generated(model, GenerateRequest(tools=TOOLS, force=force, max_call_tokens=48, temperature=0))
    call = assert_schema_valid_xml_call(model.parser, text, NAMES if force == "*" else [force])
    function = {"name": call.name, "arguments": call.arguments}
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": function}]}]
    # the next turn's prompt holds the call exactly as it was generated (the prefix is reused)
    assert text in model.tokenizer.decode(model.render(history, TOOLS, generation_prompt=False))


@pytest.mark.parametrize("wanted", ["get_weather", "lookup_capital"])
def test_a_call_the_model_starts_is_constrained_and_its_logits_pick_the_tool(model, wanted):
    """tool_choice auto: the model writes <tool_call> (steered here by a logit bias), the decoder
    takes over; among several tools the model's logits choose the name."""
    start = model.tokenizer.convert_tokens_to_ids("<tool_call>")
    bias = {start: 100.0, first_difference(model, wanted): 50.0}
    request = GenerateRequest(
        tools=TOOLS, max_new_tokens=1, max_call_tokens=48, temperature=0, logit_bias=bias
    )
    text = generated(model, request)
    call = assert_schema_valid_xml_call(model.parser, text, NAMES)
    assert call.name == wanted


def test_the_xml_body_closes_inside_its_budget():
    """A model that never wants to close a value (no newline, no markup): the call still ends,
    every required parameter present, within the budget of sampled tokens."""
    tok = make_tiny_tokenizer()
    factory = GrammarFactory(tok, 512, (tok.eos_token_id,))
    schema = EDIT["function"]["parameters"]
    scores = torch.full((512,), -10.0)
    for i in range(len(tok)):
        piece = tok.decode([i])
        if piece and not any(c in piece for c in "\n<>/"):
            scores[i] = 10.0
    floor = factory.xml_parameters(schema).closing_cost()
    parser = Qwen3CoderParser()
    for budget in (floor, floor + 1, floor + 3, floor + 20):
        run = ConstrainedDecode(
            ScoredModel(scores),
            factory.xml_parameters(schema),
            budget=budget,
            sampler=Sampler(SamplingParams()),
            tokenizer=tok,
        )
        body = "".join(run)
        assert run.finish_reason == "stop" and run.sampled <= budget and body.endswith("</function>")
        [call] = parser.parse(f"<tool_call>\n<function=edit_file>\n{body}\n</tool_call>", [EDIT]).calls
        assert call.error is None and {"path", "line", "text"} <= set(call.arguments)
        jsonschema.validate(call.arguments, schema)
        if budget == floor:  # the cheapest call: no optional parameter
            assert set(call.arguments) == {"path", "line", "text"}


class ScoredModel:
    """A TokenStepper whose next-token logits are fixed scores: the grammar's mask and the closing
    policy are all that stand between these preferences and the output."""

    def __init__(self, scores: torch.Tensor) -> None:
        self.scores = scores

    def next_logits(self) -> torch.Tensor:
        return self.scores.clone()

    def decode(self, token_id: int) -> None:
        pass

    def prefill(self, token_ids: list[int]) -> None:
        pass


# ---- the Agent, ChatFreeToken, the server ---------------------------------------------------------------
def test_an_agent_run_with_a_forced_call(model):
    agent = Agent(
        model,
        [multiply],
        tool_choice=lambda step: "multiply" if step == 1 else "none",
        max_new_tokens=8,
        isolate_runs=False,  # the run's context stays on `model`
    )
    result = agent.run("What is 6 times 7?")
    [record] = result.trace.tool_calls
    assert record.tool == "multiply" and record.error is None
    assert record.result == record.arguments["a"] * record.arguments["b"]
    calls = [m for m in result.messages if m.get("tool_calls")]
    assert calls[0]["tool_calls"][0]["function"]["arguments"] == record.arguments
    context = model.tokenizer.decode(model.token_ids)
    assert "<tool_call>\n<function=multiply>\n<parameter=a>\n" in context  # the run's history, re-rendered


def test_chatfreetoken_returns_a_forced_call_parsed(monkeypatch):
    from freetoken_agents.integrations.langchain import ChatFreeToken
    from freetoken_agents.integrations.langchain.engines import EngineHandle

    contexts: list[list[int]] = []  # each call's own context as the call ends (its prompt and reply)
    real_release = EngineHandle.release_context

    def release_context(self: EngineHandle, context, *, keep: bool = True) -> None:
        contexts.append(list(context.token_ids))
        real_release(self, context, keep=keep)

    monkeypatch.setattr(EngineHandle, "release_context", release_context)

    llm = ChatFreeToken(
        model=str(default_model()), tool_format="qwen3_coder", max_call_tokens=48, temperature=0
    )
    handle = llm._handle()
    handle.engine.tokenizer.chat_template = real_template(TEMPLATE)  # this handle's own engine
    for choice in ("get_weather", "any"):
        msg = llm.bind_tools(TOOLS, tool_choice=choice).invoke("What is the weather in Paris?")
        assert msg.invalid_tool_calls == [] and len(msg.tool_calls) == 1
        [call] = msg.tool_calls
        context = handle.backend.tokenizer.decode(contexts[-1])
        generated_text = context[
            context.rindex("<tool_call>") : context.rindex("</tool_call>") + len("</tool_call>")
        ]
        parsed = assert_schema_valid_xml_call(handle.backend.parser, generated_text, NAMES)
        assert (call["name"], call["args"]) == (parsed.name, parsed.arguments)
        if choice != "any":
            assert call["name"] == choice


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_returns_a_forced_call_parsed(stream):
    engine = Engine.from_pretrained(shared_engine().source)
    engine.tokenizer.chat_template = real_template(TEMPLATE)
    with running_server(engine) as server:
        backend = server.app.state.server.backend
        assert isinstance(backend.parser, Qwen3CoderParser)
        for choice in ("required", {"type": "function", "function": {"name": "multiply"}}):
            kwargs = dict(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=48
            )
            if stream:
                calls: dict[int, dict[str, str]] = {}
                for chunk in server.client().chat.completions.create(stream=True, **kwargs):
                    for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                        slot = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                        slot["name"] += delta.function.name or ""
                        slot["arguments"] += delta.function.arguments or ""
                [(name, arguments)] = [(c["name"], c["arguments"]) for c in calls.values()]
            else:
                reply = server.client().chat.completions.create(**kwargs)
                assert reply.choices[0].finish_reason == "tool_calls"
                [tool_call] = reply.choices[0].message.tool_calls
                name, arguments = tool_call.function.name, tool_call.function.arguments
            context = backend.tokenizer.decode(backend.token_ids)
            generated_text = context[
                context.rindex("<tool_call>") : context.rindex("</tool_call>") + len("</tool_call>")
            ]
            parsed = assert_schema_valid_xml_call(backend.parser, generated_text, NAMES)
            assert (name, json.loads(arguments)) == (parsed.name, parsed.arguments)
            if isinstance(choice, dict):
                assert name == "multiply"
