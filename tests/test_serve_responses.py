"""POST /v1/responses driven by the real `openai` client (and, when installed, the openai-agents
SDK): text, instructions, function tools with tool_choice, a conversation that goes on with a
function_call_output, structured output, the semantic stream events in order, usage with cached
tokens, the wire shape of a few fields, and the fields refused with a 400 naming them, on the
embedded model. A Responses request runs the chat turn a chat completion runs: its answers are
compared with the chat endpoint's for the same conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serve_harness import MODEL, TOOLS

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = "What is the weather in Paris?"
TIMES = "What is 12 times 7?"
FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses tool shape
SCHEMAS = {tool["name"]: tool["parameters"] for tool in FUNCTIONS}


def chat_text(client, messages, **kwargs) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return r.choices[0].message.content


def test_a_text_response_is_the_chat_turn_as_a_message_item_with_usage(client):
    r = client.responses.create(model=MODEL, input=WEATHER, temperature=0, max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.error is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.text and r.output_text == part.text
    assert part.text == chat_text(client, [{"role": "user", "content": WEATHER}], max_tokens=24)
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 24 + 1
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens


def test_instructions_and_message_items_render_as_the_chat_messages(client):
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": WEATHER},
    ]
    r = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input=items, temperature=0, max_output_tokens=16
    )
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": WEATHER},
    ]
    assert r.output_text == chat_text(client, messages, max_tokens=16)


def test_tool_choice_required_gives_a_function_call_whose_arguments_fit_the_schema(client):
    r = client.responses.create(
        model=MODEL, input=WEATHER, tools=FUNCTIONS, tool_choice="required", temperature=0
    )
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.status == "completed" and call.id.startswith("fc_")
    assert call.call_id and call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_a_named_function_choice_forces_that_function(client):
    choice = {"type": "function", "name": "multiply"}
    r = client.responses.create(model=MODEL, input=TIMES, tools=FUNCTIONS, tool_choice=choice, temperature=0)
    [call] = r.output
    assert call.name == "multiply" and json.loads(call.arguments) == {"a": 12, "b": 7}
    none = client.responses.create(
        model=MODEL, input=WEATHER, tools=FUNCTIONS, tool_choice="none", temperature=0, max_output_tokens=8
    )
    assert [item.type for item in none.output] == ["message"]


def test_a_function_call_output_continues_the_conversation_as_chat_does(client):
    first = client.responses.create(model=MODEL, input=WEATHER, tools=FUNCTIONS, temperature=0)
    [call] = first.output  # auto: the embedded model calls get_weather for this question
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    items = [
        {"role": "user", "content": WEATHER},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    second = client.responses.create(
        model=MODEL, input=items, tools=FUNCTIONS, temperature=0, max_output_tokens=32
    )
    assert [item.type for item in second.output] == ["message"] and second.output_text
    messages = [
        {"role": "user", "content": WEATHER},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]
    assert second.output_text == chat_text(client, messages, tools=TOOLS, max_tokens=32)
    # the first call's prompt and reply were kept: the second prompt reuses their KV
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2


def test_structured_output_through_text_format_is_schema_valid_json(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}
    r = client.responses.create(model=MODEL, input=WEATHER, text=fmt, temperature=0, max_output_tokens=40)
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_max_output_tokens_leaves_an_incomplete_response(client):
    r = client.responses.create(model=MODEL, input=WEATHER, temperature=0, max_output_tokens=1)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 1


def text_event_order(types: list[str]) -> list[str]:
    """`types` with runs of deltas collapsed to one."""
    out: list[str] = []
    for t in types:
        if not (out and out[-1] == t and t.endswith(".delta")):
            out.append(t)
    return out


def test_a_streamed_text_response_sends_the_semantic_events_in_order(client):
    plain = client.responses.create(model=MODEL, input=WEATHER, temperature=0, max_output_tokens=24)
    with client.responses.stream(model=MODEL, input=WEATHER, temperature=0, max_output_tokens=24) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    end = "response.completed" if plain.status == "completed" else "response.incomplete"
    assert text_event_order([e.type for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == plain.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    if end == "response.completed":
        assert (
            final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
        )


def test_a_streamed_function_call_sends_argument_events(client):
    with client.responses.stream(
        model=MODEL, input=TIMES, tools=FUNCTIONS, tool_choice="required", temperature=0
    ) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert text_event_order(types) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"a": 12, "b": 7}


def test_the_wire_shape_of_a_response_and_its_stream(server):
    body = {"model": MODEL, "input": TIMES, "tools": FUNCTIONS, "tool_choice": "required", "temperature": 0}
    r = httpx.post(f"{server.base_url}/responses", json=body, timeout=120).json()
    assert r["object"] == "response" and r["store"] is False and r["previous_response_id"] is None
    assert set(r["usage"]) >= {"input_tokens", "output_tokens", "total_tokens", "input_tokens_details"}
    assert isinstance(r["usage"]["input_tokens_details"]["cached_tokens"], int)
    call = r["output"][0]
    assert set(call) >= {"type", "id", "call_id", "name", "arguments", "status"}
    assert isinstance(call["arguments"], str) and r["tools"][0]["type"] == "function"
    body["stream"] = True
    with httpx.stream("POST", f"{server.base_url}/responses", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = response.read().decode().strip().split("\n\n")
    for number, block in enumerate(blocks):
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}" and data["sequence_number"] == number
    assert json.loads(blocks[-1].split("\n")[1][6:])["response"]["output"][0]["type"] == "function_call"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
            "input[0].content[0].type",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        (
            {"input": [{"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{oops"}]},
            "input[0].arguments",
        ),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        (
            {
                "tools": FUNCTIONS,
                "tool_choice": {"type": "function", "name": "multiply"},
                "max_output_tokens": 1,
            },
            "max_output_tokens",
        ),
    ],
)
def test_what_the_server_cannot_do_is_a_400_naming_the_field(client, fields, param):
    body = {"model": MODEL, "input": WEATHER, "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**body)
    assert caught.value.body["param"] == param, caught.value.body


def test_an_error_after_the_stream_began_is_an_error_event_then_response_failed(server):
    body = {
        "model": MODEL,
        "input": TIMES,
        "tools": FUNCTIONS,
        "tool_choice": {"type": "function", "name": "multiply"},
        "max_output_tokens": 1,  # the call cannot close in one token: found once the turn runs
        "stream": True,
    }
    with httpx.stream("POST", f"{server.base_url}/responses", json=body, timeout=120) as response:
        events = [json.loads(b.split("\n")[1][6:]) for b in response.read().decode().strip().split("\n\n")]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert events[2]["param"] == "max_output_tokens" and "max_output_tokens" in events[2]["message"]
    assert events[3]["response"]["status"] == "failed" and events[3]["response"]["error"]["message"]


def test_an_unknown_model_is_a_404_and_the_server_goes_on(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input=WEATHER)
    assert client.responses.create(model=MODEL, input=WEATHER, max_output_tokens=2).output


def test_an_openai_agents_agent_calls_a_function_tool_through_the_server(server):
    agents = pytest.importorskip(
        "agents", reason="openai-agents is not installed (pip install openai-agents)"
    )
    agents.set_tracing_disabled(True)  # tracing would export to OpenAI: no network in tests
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        seen.append(city)
        return f"Sunny, 21 C in {city}"

    model = agents.OpenAIResponsesModel(
        model=MODEL,
        openai_client=openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0),
    )
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(temperature=0, max_tokens=48),
    )
    result = agents.Runner.run_sync(agent, WEATHER, max_turns=4)
    assert seen == ["Paris"]  # the call came back as a function_call item the SDK ran
    assert isinstance(result.final_output, str) and result.final_output
