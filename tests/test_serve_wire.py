"""`freetoken serve` on the wire as OpenAI clients expect it (issue 63): the exact JSON of replies
and of stream chunks (null fields present where OpenAI sends null, absent where OpenAI leaves them
out), `model` optional, GET /v1/models/{id}, CORS for browser apps, and errors that name the field
as the user wrote it. Checked on the raw bytes (httpx, SSE lines) and with the `openai` client."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from serve_harness import MODEL, TOOLS, running_server, shared_engine, wait_until

from freetoken_agents.cli import main
from freetoken_agents.integrations.openai_server import InvalidOrigin, ServerConfig, create_app, server_config

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
APP = "http://localhost:3000"  # a browser app's origin


@pytest.fixture(scope="module")
def server():
    with running_server(cors_origins=(APP,)) as s:
        yield s


def post(server, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", json=body, headers=headers, timeout=60)


def sse(server, body: dict) -> list[dict[str, Any]]:
    """The stream's events as JSON, checking it ends with `data: [DONE]`."""
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` (as `freetoken serve` built it) on a free loopback port; yields its /v1 URL."""
    server = uvicorn.Server(server_config(app, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the server to start")
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


# ---- replies ------------------------------------------------------------------------------------
def test_a_reply_has_every_field_openai_sends_and_no_other(server):
    r = post(server, {"model": MODEL, "messages": WEATHER, "temperature": 0, "max_tokens": 6})
    reply = r.json()
    assert set(reply) == {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
    assert reply["system_fingerprint"].startswith("fp_")
    [choice] = reply["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"} and choice["logprobs"] is None
    assert choice["message"] == {
        "role": "assistant",
        "content": choice["message"]["content"],
        "refusal": None,
    }
    assert isinstance(choice["message"]["content"], str)
    usage = reply["usage"]
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


def test_a_tool_call_reply_sends_content_null(server):
    body = {"model": MODEL, "messages": WEATHER, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    message = post(server, body).json()["choices"][0]["message"]
    assert "content" in message and message["content"] is None  # OpenAI sends the key, as null
    assert message["refusal"] is None and "reasoning_content" not in message
    [call] = message["tool_calls"]
    assert set(call) == {"id", "type", "function"} and set(call["function"]) == {"name", "arguments"}


def test_the_openai_client_reads_the_new_fields(server):
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=WEATHER, temperature=0, max_tokens=4)
    assert r.system_fingerprint and r.system_fingerprint.startswith("fp_")
    assert "logprobs" in r.choices[0].model_fields_set and r.choices[0].logprobs is None
    again = client.chat.completions.create(model=MODEL, messages=WEATHER, temperature=0, max_tokens=4)
    assert again.system_fingerprint == r.system_fingerprint  # same server, engine and model


# ---- streams ------------------------------------------------------------------------------------
def test_every_stream_chunk_carries_finish_reason_and_logprobs(server):
    chunks = sse(
        server, {"model": MODEL, "messages": WEATHER, "temperature": 0, "max_tokens": 6, "stream": True}
    )
    for chunk in chunks:
        assert set(chunk) == {"id", "object", "created", "model", "system_fingerprint", "choices"}  # no usage
        [choice] = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"} and choice["logprobs"] is None
    deltas = [c["choices"][0]["delta"] for c in chunks]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) == {"content"} for d in deltas[1:-1]) and deltas[-1] == {}
    assert finishes[:-1] == [None] * (len(chunks) - 1) and finishes[-1] in ("stop", "length")
    assert len({c["system_fingerprint"] for c in chunks}) == 1


def test_with_include_usage_every_chunk_has_usage_null_but_the_last(server):
    body = {
        "model": MODEL,
        "messages": WEATHER,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = sse(server, body)
    assert all("usage" in c for c in chunks)
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_a_streamed_tool_call_delta_and_the_openai_client(server):
    body = {"messages": WEATHER, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "stream": True}
    chunks = sse(server, {"model": MODEL, **body})
    calls = [d["tool_calls"] for c in chunks if "tool_calls" in (d := c["choices"][0]["delta"])]
    assert len(calls) == 1 and set(calls[0][0]) == {"index", "id", "type", "function"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    streamed = list(server.client().chat.completions.create(model=MODEL, **body))
    assert [c.choices[0].finish_reason for c in streamed][-2:] == [None, "tool_calls"]
    assert all("finish_reason" in c.choices[0].model_fields_set for c in streamed)


# ---- model ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["absent", None])
def test_model_may_be_left_out_when_one_model_is_served(server, model):
    body = {"messages": WEATHER, "max_tokens": 2, **({} if model == "absent" else {"model": model})}
    r = post(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    assert post(server, {**body, "model": "gpt-4o"}).status_code == 404  # a wrong one is still refused


def test_a_model_is_retrieved_by_id_and_an_unknown_id_is_a_404(server):
    client = server.client()
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "freetoken"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and error["type"]


def test_a_served_hub_id_with_a_slash_is_retrieved_and_needs_the_key():
    app = create_app(shared_engine(), ServerConfig(model_name="org/tiny@main", api_key="sesame"))
    with serving(app) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="sesame", max_retries=0)
        assert client.models.retrieve("org/tiny@main").id == "org/tiny@main"
        assert httpx.get(f"{base_url}/models/org/tiny@main", timeout=30).status_code == 401
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org/other")


# ---- CORS -----------------------------------------------------------------------------------------
def preflight(base_url: str, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    return httpx.options(f"{base_url}/chat/completions", headers=headers, timeout=30)


def test_a_browser_preflight_from_an_allowed_origin_is_answered(server):
    r = preflight(server.base_url, APP)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == APP
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers  # the key is a header, never a cookie
    refused = preflight(server.base_url, "https://elsewhere.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def test_actual_requests_from_the_origin_are_marked_readable(server):
    body = {"model": MODEL, "messages": WEATHER, "max_tokens": 2}
    assert post(server, body, Origin=APP).headers["access-control-allow-origin"] == APP
    url, streamed = f"{server.base_url}/chat/completions", {**body, "stream": True}
    with httpx.stream("POST", url, json=streamed, headers={"Origin": APP}, timeout=60) as r:
        assert r.headers["access-control-allow-origin"] == APP
    error = post(server, {"messages": []}, Origin=APP)  # the app can read its errors too
    assert error.status_code == 400 and error.headers["access-control-allow-origin"] == APP
    assert "retry-after" in error.headers["access-control-expose-headers"].lower()
    models = httpx.get(
        f"{server.base_url}/models", headers={"Origin": "https://elsewhere.example"}, timeout=30
    )
    assert "access-control-allow-origin" not in models.headers


def test_cors_is_off_by_default():
    with running_server() as s:
        r = preflight(s.base_url, APP)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        actual = post(s, {"model": MODEL, "messages": WEATHER, "max_tokens": 1}, Origin=APP)
        assert actual.status_code == 200 and "access-control-allow-origin" not in actual.headers


def test_freetoken_serve_cors_origin_is_repeatable(monkeypatch):
    import freetoken_agents.integrations.openai_server as package

    built: list[Any] = []
    monkeypatch.setattr(package, "serve", lambda app, **settings: built.append(app))  # never listens
    other = "https://app.example:8443"
    assert main(["--threads", "1", "serve", "--port", "0", "--cors-origin", APP, "--cors-origin", other]) == 0
    with serving(built[0]) as base_url:
        assert preflight(base_url, APP).headers["access-control-allow-origin"] == APP
        assert preflight(base_url, other).headers["access-control-allow-origin"] == other


@pytest.mark.parametrize("origin", ["http://localhost:3000/", "localhost:3000", "http://a.example/app", ""])
def test_an_origin_no_browser_sends_is_one_error_line(origin, capsys):
    assert main(["serve", "--port", "0", "--cors-origin", origin]) == 1  # before the engine loads
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken serve: error: --cors-origin: CORS origin") and "\n" not in err
    with pytest.raises(InvalidOrigin):
        ServerConfig(model_name=MODEL, cors_origins=(origin,))


# ---- errors in the user's terms ---------------------------------------------------------------------
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {"messages": [{"role": "user", "content": [IMAGE]}]},
            "messages[0].content[0]",
            "images are not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, IMAGE]}]},
            "messages[0].content[1]",
            "images are not supported",
        ),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            "expected one of a string or an array of objects, but got an integer",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
            "Missing",
        ),
        ({"messages": [*WEATHER, {"role": "robot", "content": "x"}]}, "messages[1].role", "'robot'"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "Missing required parameter"),
        ({"messages": WEATHER, "stop": 5}, "stop", "expected one of a string or an array"),
        ({"messages": WEATHER, "stop": ["a", 1]}, "stop[1]", "expected a string, but got an integer"),
        ({"messages": WEATHER, "tool_choice": "sometimes"}, "tool_choice", "'auto', 'none' or 'required'"),
        ({"messages": WEATHER, "temperature": "hot"}, "temperature", "expected a number, but got a string"),
    ],
)
def test_a_malformed_request_names_one_problem_in_the_users_terms(server, extra, param, says):
    r = post(server, {"model": MODEL, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    leaks = ("more problems", ".str", "list[", "literal[", "TextPart", ".user.", "NamedToolChoice")
    assert not any(leak in error["message"] + error["param"] for leak in leaks), error


def test_the_openai_client_gets_the_image_error_as_a_bad_request(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [IMAGE]}])
    assert caught.value.body["param"] == "messages[0].content[0]"
    assert "images are not supported" in caught.value.body["message"]
