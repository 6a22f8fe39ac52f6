"""Every way a request can be wrong gets an OpenAI-style error body with the status OpenAI uses (so
the `openai` client raises its usual exception), and the server keeps serving after each."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_harness import MODEL, TOOLS, running_server

pytestmark = pytest.mark.usefixtures("one_thread")

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with running_server(api_key="sesame") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key="sesame")


def post(server, body=None, *, raw: bytes | None = None, key: str | None = "sesame") -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    content = raw if raw is not None else httpx.Request("POST", "http://x", json=body).content
    return httpx.post(f"{server.base_url}/chat/completions", content=content, headers=headers, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.fixture(autouse=True)
def still_serving(client):
    """After each test, a plain request still succeeds."""
    yield
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_without_the_key_requests_get_401(server):
    assert (
        error_of(post(server, {"model": MODEL, "messages": HI}, key=None), 401)["code"] == "invalid_api_key"
    )
    assert post(server, {"model": MODEL, "messages": HI}, key="wrong").status_code == 401
    assert post(server, raw=b"{not json", key=None).status_code == 401  # the key is checked first
    assert httpx.get(f"{server.base_url}/models", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").chat.completions.create(model=MODEL, messages=HI)
    assert server.health()["status"] == "ok"  # /health needs no key


def test_malformed_json_is_a_400(server):
    error = error_of(post(server, raw=b'{"model": "x", "messages": ['), 400)
    assert "could not parse the JSON body" in error["message"] and error["type"] == "invalid_request_error"
    assert error_of(post(server, raw=b"[1, 2]"), 400)["message"] == "the request body must be a JSON object"


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        ([{"role": "robot", "content": "hi"}], "messages[0].role", "robot"),
        ([{"role": "user"}], "messages[0].content", "Missing required parameter"),
        ([], "messages", "at least 1"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id", "Missing required parameter"),
        (
            [
                *HI,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{bad"}}],
                },
            ],
            "messages[1].tool_calls[0].function.arguments",
            "not valid JSON",
        ),
    ],
)
def test_malformed_messages_are_400s_naming_the_field(server, messages, param, words):
    error = error_of(post(server, {"model": MODEL, "messages": messages}), 400)
    assert error["param"] == param and words in error["message"]


def test_schemas_the_grammar_cannot_compile_are_400s(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    error = error_of(post(server, {"model": MODEL, "messages": HI, "response_format": fmt}), 400)
    assert error["param"] == "response_format.json_schema.schema" and "wat" in error["message"]
    bad_tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}},
    }
    error = error_of(post(server, {"model": MODEL, "messages": HI, "tools": [bad_tool]}), 400)
    assert error["param"] == "tools.f" and "cannot be compiled" in error["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"n": 9}, "n"),  # n, logprobs and penalties are served: out of bounds is the error
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"temperature": 3}, "temperature"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_unsupported_or_invalid_options_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, **extra)
    assert e.value.body["param"] == param


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]


def test_a_request_over_the_context_is_a_400_naming_the_limits(client, server):
    limit = server.engine.max_context
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 2000}])
    assert e.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=limit)
    message = e.value.body["message"]
    assert f"is {limit} tokens" in message and f"{limit} in the completion" in message
    assert e.value.body["param"] == "max_tokens"


def test_a_forced_call_that_cannot_fit_max_tokens_is_a_400(client):
    choice = {"type": "function", "function": {"name": "multiply"}}  # two integers: 2 sampled tokens at least
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=HI, tools=TOOLS, tool_choice=choice, max_tokens=1
        )
    assert e.value.body["param"] == "max_tokens" and "too small" in e.value.body["message"]
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, tools=TOOLS, tool_choice=choice, max_tokens=1, stream=True
    )
    with pytest.raises(openai.APIError, match="too small"):  # after the headers: an error event
        list(stream)


def test_unknown_routes_are_openai_style_404s(server):
    error = error_of(httpx.get(f"{server.root}/v1/nothing", timeout=30), 404)
    assert error["type"] == "not_found_error"
