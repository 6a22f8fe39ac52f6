"""Families whose call prefix names the tool (harmony, DeepSeek) with several tools offered: the model
picks the tool by its own logits among the candidates (issue 35: the decoder raised "calls with
several candidate tools are not constrained yet", a 500 on the server). Real engine, embedded
model, the family's own format forced on it."""

from __future__ import annotations

import json

import pytest
from serve_harness import MODEL, TOOLS, first_difference, running_server, shared_engine

from freetoken_agents import FreeTokenModel, GenerateRequest

pytestmark = pytest.mark.usefixtures("one_thread")

ASK = [{"role": "user", "content": "What is 6 times 7?"}]
NAMES = [t["function"]["name"] for t in TOOLS]


def forced_call(model: FreeTokenModel, bias: dict[int, float] | None = None):
    model.reset()
    model.sync(model.render(ASK, TOOLS))
    request = GenerateRequest(
        tools=TOOLS, force="*", max_call_tokens=48, temperature=0, logit_bias=bias or {}
    )
    text = "".join(e.text for e in model.generate(request) if e.kind == "text")
    return model.parser.parse(text)


@pytest.mark.parametrize("family", ["harmony", "deepseek"])
def test_a_required_call_among_several_tools_is_decoded_in_the_familys_format(family):
    model = FreeTokenModel(shared_engine(), family=family)
    [call] = forced_call(model).calls
    assert call.error is None and call.name in NAMES and isinstance(call.arguments, dict)


@pytest.mark.parametrize("family", ["harmony", "deepseek"])
@pytest.mark.parametrize("wanted", ["multiply", "get_weather"])
def test_the_models_logits_pick_the_tool(family, wanted):
    model = FreeTokenModel(shared_engine(), family=family)
    [call] = forced_call(model, {first_difference(model, wanted): 50.0}).calls
    assert call.name == wanted and call.error is None


def test_the_server_answers_a_required_call_among_several_harmony_tools():
    with running_server(family="harmony") as server:
        reply = server.client().chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=48
        )
    [call] = reply.choices[0].message.tool_calls  # the old server answered 500
    assert call.function.name in NAMES and isinstance(json.loads(call.function.arguments), dict)
