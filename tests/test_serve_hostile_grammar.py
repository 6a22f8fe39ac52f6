"""Hostile requests against the server's grammar compile and message checks (issue 59, items 2 and
11), over a real server and HTTP: a small schema whose pattern would compile for minutes is a 400
before compiling, a slow compile delays its own request and never the engine worker that serves
everyone, and a past tool call's arguments nested too deep or holding a 5,001-digit number are a
400 naming them, not a 500."""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest
from serve_harness import MODEL, running_server

from freetoken_agents.schema_check import MAX_PATTERN_STATES

pytestmark = pytest.mark.usefixtures("one_thread")

HI = [{"role": "user", "content": "hi"}]
SAFETY = 90  # seconds: only against a hang (a request stuck behind a blocked engine worker)


@pytest.fixture(scope="module")
def server():
    with running_server(grammar_timeout_s=0.5) as s:
        yield s


def post(server, body: dict, timeout: float = SAFETY) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=timeout)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    return error


def answered(server) -> None:
    reply = post(server, {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


# ---- item 2: one small request stalled the server for every client --------------------------------
PATTERN_TOOL = {  # the issue's 380-byte tool: more than 90 s to compile on the engine worker
    "type": "function",
    "function": {
        "name": "set_code",
        "description": "Set the access code.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^(a|b){1,20000}$"}},
            "required": ["code"],
        },
    },
}


def test_the_issues_pattern_is_a_400_before_compiling_and_the_next_request_is_answered(server):
    grammars = server.app.state.server.backend.grammars()
    compiles: list[str] = []
    real = grammars.compiler.compile_json_schema
    grammars.compiler.compile_json_schema = lambda key, **k: compiles.append(key) or real(key, **k)
    try:
        body = {"model": MODEL, "messages": HI, "tools": [PATTERN_TOOL], "tool_choice": "required"}
        error = error_of(post(server, body), 400)
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": PATTERN_TOOL["function"]["parameters"]},
        }
        error2 = error_of(post(server, {"model": MODEL, "messages": HI, "response_format": fmt}), 400)
    finally:
        del grammars.compiler.compile_json_schema
    assert error["param"] == "tools.set_code" and "properties.code.pattern" in error["message"]
    assert str(MAX_PATTERN_STATES) in error["message"]
    assert error2["param"] == "response_format.json_schema.schema"
    assert not compiles  # refused before the compiler saw it
    answered(server)


class GatedCompiles:
    """Hold the compile of schemas carrying `marker` until `release` (the compile of an allowed
    schema that takes long on a large vocabulary, at a moment the test chooses)."""

    def __init__(self, grammars) -> None:
        self.grammars, self.marker = grammars, f"gate-{uuid.uuid4()}"
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []
        self.real = grammars.compiler.compile_json_schema

    def __enter__(self) -> GatedCompiles:
        def gated(key: str, **kwargs):
            if self.marker in key:
                self.threads.append(threading.current_thread().name)
                self.entered.set()
                self.release.wait(SAFETY)
            return self.real(key, **kwargs)

        self.grammars.compiler.compile_json_schema = gated
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        del self.grammars.compiler.compile_json_schema

    def body(self, n: int = 0) -> dict:
        schema = {"type": "object", "description": f"{self.marker}-{n}"}
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        return {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": 0, "response_format": fmt}


def test_a_slow_compile_delays_only_its_own_request(server):
    with GatedCompiles(server.app.state.server.backend.grammars()) as gate:
        slow, result = threading.Thread(target=lambda: result.append(post(server, gate.body()))), []
        slow.start()
        assert gate.entered.wait(SAFETY), "the schema was never compiled"
        answered(server)  # served while the slow compile is held: the engine worker is free
        assert gate.threads == ["freetoken-grammar"]  # compiled off the engine worker
        slow.join(SAFETY)
    # past its deadline (0.5 s) the slow one was refused: by its own param, as too slow to compile
    error = error_of(result[0], 400)
    assert (
        error["param"] == "response_format.json_schema.schema"
        and "did not compile within 0.5 s" in error["message"]
    )
    assert server.queue()["running"] == 0


def test_a_compile_queued_behind_a_held_one_is_a_503_and_the_retry_is_served(server):
    with GatedCompiles(server.app.state.server.backend.grammars()) as gate:
        slow, result = threading.Thread(target=lambda: result.append(post(server, gate.body(1)))), []
        slow.start()
        assert gate.entered.wait(SAFETY)
        other = {"type": "object", "properties": {"x": {"type": "integer"}}, "description": "queued"}
        fmt = {"type": "json_schema", "json_schema": {"name": "y", "schema": other}}
        busy = post(server, {"model": MODEL, "messages": HI, "max_tokens": 8, "response_format": fmt})
        error = error_of(busy, 503)
        assert error["code"] == "grammar_compiler_busy" and busy.headers["retry-after"] == "1"
        gate.release.set()
        slow.join(SAFETY)
        retry = post(server, {"model": MODEL, "messages": HI, "max_tokens": 8, "response_format": fmt})
    assert retry.status_code == 200, retry.text


# ---- item 11: a past call's arguments -----------------------------------------------------------
def with_arguments(arguments: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}
    return {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "add 2 and 3"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ],
    }


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper"),  # was a RecursionError: 500
        ('{"a": ' + "[" * 70 + "]" * 70 + "}", "nested deeper"),
        ('{"a": ' + "7" * 5_001 + "}", "5001 characters"),  # was a ValueError (int digit limit): 500
        ('{"a": 1e999}', "out of range"),  # Infinity, which the template would write as such
        ('{"a": NaN}', "not a JSON value"),
    ],
    ids=["100k-deep", "70-deep", "5001-digits", "1e999", "NaN"],
)
def test_tool_call_arguments_too_deep_or_with_absurd_numbers_are_400s(server, arguments, says):
    error = error_of(post(server, with_arguments(arguments)), 400)
    assert error["param"] == "messages[1].tool_calls[0].function.arguments" and says in error["message"]


def test_ordinary_tool_call_arguments_are_served(server):
    reply = post(server, with_arguments('{"a": 2, "b": 3.5, "n": {"deep": [[[1]]]}}'))
    assert reply.status_code == 200, reply.text
    answered(server)
