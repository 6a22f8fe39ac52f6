"""Agents over HTTP: FreeToken's `Agent` on `OpenAICompatibleModel` (any OpenAI-compatible server;
here `freetoken serve`) with a failing tool, rollback and the server's cached tokens, and
LangChain's `ChatOpenAI` in `create_agent` with two tools."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_harness import MODEL, running_server

from freetoken_agents import Agent, ModelBackend, ModelServerError, OpenAICompatibleModel, tool
from freetoken_agents.recipes.tiny.world import add, lookup_capital, multiply
from freetoken_agents.recipes.tiny.world import get_weather as world_weather

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def uncached():
    with running_server(prefix_cache=False) as s:
        yield s


def flaky_weather(failures: int):
    """get_weather (the embedded model's tool) failing its first `failures` calls; `.calls`."""
    calls: list[str] = []

    @tool
    def get_weather(city: str) -> dict:
        """Current weather for a city."""
        calls.append(city)
        if len(calls) <= failures:
            raise ValueError(f"unknown city {city!r}")
        return {"city": city, "condition": "sunny", "temperature_c": 21}

    get_weather.calls = calls  # type: ignore[attr-defined]
    return get_weather


def recording_model(base_url: str) -> tuple[OpenAICompatibleModel, list[dict]]:
    """An OpenAICompatibleModel whose client records every request body it sends."""
    bodies: list[dict] = []
    hook = {"request": [lambda r: bodies.append(json.loads(r.content)) if r.method == "POST" else None]}
    client = openai.OpenAI(
        base_url=base_url, api_key="unused", max_retries=0, http_client=httpx.Client(event_hooks=hook)
    )
    return OpenAICompatibleModel(base_url, MODEL, client=client), bodies


def weather_agent(model, weather) -> Agent:
    first_turn_calls = lambda step: "required" if step == 1 else "none"  # noqa: E731
    return Agent(model, [add, multiply, weather, lookup_capital], tool_choice=first_turn_calls, max_steps=3)


def test_the_agent_rolls_back_a_failed_call_and_the_server_absorbs_the_resent_prefix(server):
    weather = flaky_weather(failures=1)
    model, bodies = recording_model(server.base_url)
    assert isinstance(model, ModelBackend)
    result = weather_agent(model, weather).run("What is the weather in Paris?")

    assert len(weather.calls) == 2 and len(result.trace.rollbacks) == 1
    assert "ValueError: unknown city" in result.trace.rollbacks[0].reason
    # Requests: the call, the retry after the rollback, the answer.
    assert len(bodies) == 3
    first, retry, answer = bodies
    assert first["tool_choice"] == "required" and retry["tool_choice"] == "required"
    # The rollback re-sends the kept prefix (the same messages) plus the unfinished turn: the note.
    assert retry["messages"][: len(first["messages"])] == first["messages"]
    [note] = retry["messages"][len(first["messages"]) :]
    assert note["role"] == "assistant" and "attempt 1 failed" in note["content"]
    assert answer["tool_choice"] == "none" and answer["messages"][-1]["role"] == "tool"
    # The completed call and its result are in the run's messages, as structured tool calls.
    calls = [c for m in result.messages for c in m.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert [m for m in result.messages if m["role"] == "tool"][0]["content"].startswith('{"city"')
    assert "<tool_call>" in model.text  # tool_calls arrived structured and sit in the transcript
    # usage() is the server's: its cached tokens are what the re-sent prefix did not cost.
    usage = model.usage()
    assert usage.reused > 0 and usage.decoded > 0 and usage.prefilled > 0
    assert result.trace.tokens_reused == usage.reused


def test_without_the_server_cache_the_same_run_prefills_everything(server, uncached):
    runs = {}
    for name, s in (("cached", server), ("uncached", uncached)):
        model = OpenAICompatibleModel(s.base_url, MODEL)
        weather = flaky_weather(failures=1)
        result = weather_agent(model, weather).run("What is the weather in Paris?")
        runs[name] = (result, weather.calls, model.usage())
    (cached, cached_calls, with_cache), (plain, plain_calls, without) = runs["cached"], runs["uncached"]
    assert cached.output == plain.output and cached_calls == plain_calls  # reuse changes no answer
    assert without.reused == 0 and with_cache.reused > 0
    assert with_cache.prefilled + with_cache.reused == without.prefilled  # the same prompts in all
    assert with_cache.prefilled < without.prefilled


def test_a_server_error_stops_the_run_with_a_named_error(server):
    model = OpenAICompatibleModel(server.base_url, "no-such-model", max_retries=0)
    with pytest.raises(ModelServerError) as e:
        Agent(model, [multiply]).run("What is 2 times 3?")
    assert e.value.status == 404 and "does not exist" in str(e.value)


def test_langchain_chat_openai_runs_create_agent_with_two_tools(server):
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI

    seen: list[str] = []
    # The schemas exactly as the embedded model saw them in training (key order included).
    schema = {t.name: t.json_schema()["function"]["parameters"] for t in (world_weather, multiply)}

    @lc_tool(args_schema=schema["get_weather"])
    def get_weather(city: str) -> dict:
        """Current weather for a city."""
        seen.append(city)
        return {"city": city, "condition": "sunny", "temperature_c": 21}

    @lc_tool("multiply", args_schema=schema["multiply"])
    def times(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    llm = ChatOpenAI(
        model=MODEL, base_url=server.base_url, api_key="unused", temperature=0, max_tokens=48, max_retries=0
    )
    agent = create_agent(llm, [get_weather, times])
    state = agent.invoke({"messages": [("user", "What is the weather in Paris?")]})
    messages = state["messages"]
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls and calls[0]["name"] == "get_weather" and calls[0]["args"] == {"city": "Paris"}
    assert seen[0] == "Paris" and any(isinstance(m, ToolMessage) for m in messages)
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and final.content
    # The second model call re-sent the history; the server reused the first prompt's KV.
    ai = [m for m in messages if isinstance(m, AIMessage)]
    assert ai[-1].usage_metadata["input_token_details"]["cache_read"] >= ai[0].usage_metadata["input_tokens"]
