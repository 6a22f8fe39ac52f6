"""Hostile request bodies get OpenAI-style 4xx errors, never a 500, and the server keeps serving:
an oversized body (413, counted while reading), deeply nested JSON, an out-of-range seed and a lone
UTF-16 surrogate (400s)."""

from __future__ import annotations

import httpx
import pytest
from serve_harness import MODEL, running_server

pytestmark = pytest.mark.usefixtures("one_thread")

HI = [{"role": "user", "content": "hi"}]
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    with running_server(max_request_bytes=LIMIT) as s:
        yield s


def post(server, raw: bytes, **kwargs) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(
        f"{server.base_url}/chat/completions", content=raw, headers=headers, timeout=60, **kwargs
    )


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "\n" not in error["message"]
    return error


@pytest.fixture(autouse=True)
def still_serving(server):
    yield
    r = server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def body(content: str, **extra) -> bytes:
    return httpx.Request(
        "POST", "http://x", json={"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    ).content


def test_a_body_over_the_limit_is_a_413(server):
    error = error_of(post(server, body("x" * (2 * LIMIT))), 413)
    assert str(LIMIT) in error["message"]


def test_a_streamed_body_over_the_limit_is_a_413(server):
    """No Content-Length (chunked): the limit is counted while reading."""
    raw = body("x" * (2 * LIMIT))
    error_of(post(server, iter([raw[i : i + 4096] for i in range(0, len(raw), 4096)])), 413)


def test_deeply_nested_json_is_a_400(server):
    error = error_of(post(server, b"[" * 10_000 + b"]" * 10_000), 400)
    assert "nested" in error["message"]


@pytest.mark.parametrize("seed", [2**70, -1])
def test_a_seed_out_of_range_is_a_400(server, seed):
    error = error_of(post(server, body("hi", seed=seed, max_tokens=2)), 400)
    assert "seed" in (error["param"] or "") + error["message"]


def test_a_lone_surrogate_is_a_400(server):
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}' % (
        MODEL.encode()
    )
    error = error_of(post(server, raw), 400)
    assert "surrogate" in error["message"]
