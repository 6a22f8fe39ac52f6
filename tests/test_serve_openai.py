"""`freetoken serve` driven by the real `openai` client: plain, streamed, forced and automatic tool
calls, structured output, limits, stop strings and prefix reuse, on the embedded model."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from serve_harness import MODEL, TOOLS

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TIMES = [{"role": "user", "content": "What is 12 times 7?"}]


def test_models_and_health_answer(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == server.engine.max_context
    health = server.health()
    assert health["status"] == "ok" and health["model"] == MODEL and health["queue"]["running"] == 0


def test_a_plain_completion_has_content_finish_reason_and_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER, temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 24 + 1
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens


def test_streaming_gives_the_same_reply_in_chunks_then_usage(client):
    plain = client.chat.completions.create(model=MODEL, messages=WEATHER, temperature=0, max_tokens=24)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=WEATHER,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens


def test_the_raw_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": MODEL, "messages": WEATHER, "temperature": 0, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_a_named_tool_choice_forces_that_call_with_schema_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "multiply"}}
    r = client.chat.completions.create(
        model=MODEL, messages=TIMES, tools=TOOLS, tool_choice=choice, temperature=0
    )
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "multiply"
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)  # the form every chat template accepts
    args = json.loads(call.function.arguments)
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    assert args == {"a": 12, "b": 7}  # the embedded model copies the request's values


def test_a_forced_call_is_never_turned_into_auto(client):
    # The weather question would get get_weather under "auto"; forcing multiply must give multiply.
    choice = {"type": "function", "function": {"name": "multiply"}}
    r = client.chat.completions.create(
        model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=choice, temperature=0
    )
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["multiply"]
    r = client.chat.completions.create(
        model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="required", temperature=0
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.name in {t["function"]["name"] for t in TOOLS}


def test_auto_tool_choice_lets_the_model_call_a_tool(client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_calls_only_tools_the_request_is_about_on_the_embedded_model(server, client):
    """Relevant calls are the embedded model's default over the server too: pushed towards a call by
    a logit bias, a request no offered tool is about is answered in text."""
    [marker] = server.engine.tokenizer.encode("<tool_call>", add_special_tokens=False)
    forecast = {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "The weather forecast for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    kwargs = dict(model=MODEL, tools=[forecast], temperature=0, max_tokens=24, logit_bias={str(marker): 100})
    hello, oslo = "Hello! How are you?", "Forecast for Oslo?"
    r = client.chat.completions.create(messages=[{"role": "user", "content": hello}], **kwargs)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    r = client.chat.completions.create(messages=[{"role": "user", "content": oslo}], **kwargs)
    assert r.choices[0].message.tool_calls[0].function.name == "get_forecast"


def test_streamed_tool_call_deltas_assemble_to_the_same_call(client):
    kwargs = dict(model=MODEL, messages=TIMES, tools=TOOLS, temperature=0)
    kwargs["tool_choice"] = {"type": "function", "function": {"name": "multiply"}}
    plain = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    parts, finish = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            parts += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and {p.index for p in parts} == {0}
    name = "".join(p.function.name or "" for p in parts)
    arguments = "".join(p.function.arguments or "" for p in parts)
    assert (name, json.loads(arguments)) == (plain.function.name, json.loads(plain.function.arguments))
    assert parts[0].id and parts[0].type == "function"


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(
        model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="none", temperature=0
    )
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


def test_a_conversation_with_tool_results_goes_on(client):
    first = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *WEATHER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"city": "Paris", "condition": "sunny"}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=32
    )
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    # The earlier prompt (and the start of the reply) come from the cache: only the new tail is prefilled.
    assert r.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def test_json_schema_response_format_gives_schema_valid_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a city."}],
        response_format=fmt,
        temperature=0,
    )
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "population"}
    assert isinstance(value["city"], str) and isinstance(value["population"], int)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_response_format_gives_an_object(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=48,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_max_tokens_ends_the_reply_with_finish_reason_length(client):
    banned_stop = {"2": -100}  # the embedded model's end-of-turn token: the reply cannot end early
    r = client.chat.completions.create(
        model=MODEL, messages=WEATHER, temperature=0, max_tokens=5, logit_bias=banned_stop
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(
        model=MODEL, messages=WEATHER, temperature=0, max_completion_tokens=3, logit_bias=banned_stop
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_a_stop_string_cuts_the_reply_before_it(client):
    full = client.chat.completions.create(model=MODEL, messages=WEATHER, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = client.chat.completions.create(
        model=MODEL, messages=WEATHER, temperature=0, max_tokens=24, stop=[stop]
    )
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_the_same_seed_samples_the_same_reply(client):
    kwargs = dict(model=MODEL, messages=WEATHER, temperature=1.0, top_p=0.9, max_tokens=16)
    a = client.chat.completions.create(**kwargs, seed=7).choices[0].message.content
    b = client.chat.completions.create(**kwargs, seed=7).choices[0].message.content
    assert a == b


def test_a_repeated_prompt_is_served_from_the_cache(client):
    messages = [{"role": "system", "content": "You are terse."}, *TIMES]
    client.chat.completions.create(model=MODEL, messages=WEATHER, temperature=0, max_tokens=2)  # move away
    first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2)
    client.chat.completions.create(model=MODEL, messages=WEATHER, temperature=0, max_tokens=2)  # and again
    again = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2)
    # All but the last prompt token (recomputed for its logits) come from the anchored prefix.
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
