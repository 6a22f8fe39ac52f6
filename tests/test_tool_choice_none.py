"""tool_choice "none" is enforced by the decoder: the prompt still shows the tools, but no call can
start (issue 63, item 3). On the embedded model, which calls its tools readily, the weather
question gave `<tool_call>{"name": "get_weather", ...}</tool_call>` as the content before; now it
is a plain answer, through the server with the real `openai` client and through ChatFreeToken."""

from __future__ import annotations

import functools

import pytest
from serve_harness import MODEL, TOOLS, running_server

from freetoken_agents import default_model
from freetoken_agents.integrations.langchain import ChatFreeToken

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
MARKUP = ("<tool_call>", "</tool_call>", '"arguments"')
# Refused its call, the tiny model writes on for ~230 tokens before it ends its turn: room for that
ROOM = 400


@pytest.fixture(scope="module")
def client():
    with running_server() as s:
        yield s.client()


def test_the_model_calls_when_it_may(client):
    """The prompt the tests use does elicit a call (else the tests below would prove nothing)."""
    r = client.chat.completions.create(
        model=MODEL, messages=WEATHER, tools=TOOLS, temperature=0, max_tokens=64
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_answers_in_plain_text(client, stream):
    kwargs = dict(
        model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=ROOM
    )
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"]
    else:
        r = client.chat.completions.create(**kwargs)
        content = r.choices[0].message.content
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    assert content and not any(m in content for m in MARKUP), content


@functools.cache
def llm() -> ChatFreeToken:
    return ChatFreeToken(model=str(default_model()), max_tokens=ROOM)


def test_chatfreetoken_bind_tools_none_answers_in_plain_text():
    calling = llm().bind_tools(TOOLS).invoke(WEATHER[0]["content"])
    assert calling.tool_calls  # the same prompt calls a tool with tool_choice "auto"
    msg = llm().bind_tools(TOOLS, tool_choice="none").invoke(WEATHER[0]["content"])
    assert msg.tool_calls == [] and msg.invalid_tool_calls == []
    assert msg.content and not any(m in msg.content for m in MARKUP), msg.content
    assert msg.response_metadata["finish_reason"] == "stop"
