"""Tools: schema from the signature, validation errors, sync/async calls, timeouts; a hung tool
never starves the others nor blocks exit; process tools; results capped before the model reads them."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from typing import Literal

import pytest

from freetoken_agents import Agent, FreeTokenModel, ToolArgumentsInvalid, ToolTimeout, default_model, tool
from freetoken_agents.engine import ContextOverflowError
from freetoken_agents.testing import ScriptedModel, ToolCall
from freetoken_agents.tools import default_result_chars, result_text


@tool
def search(query: str, limit: int = 3, mode: Literal["fast", "deep"] = "fast") -> list[str]:
    """Search the index."""
    return [query] * limit


def test_schema_from_signature() -> None:
    s = search.json_schema()
    assert s["type"] == "function" and s["function"]["name"] == "search"
    assert s["function"]["description"] == "Search the index."
    params = s["function"]["parameters"]
    assert params["required"] == ["query"] and params["additionalProperties"] is False
    assert params["properties"]["limit"] == {"default": 3, "type": "integer"}
    assert params["properties"]["mode"]["enum"] == ["fast", "deep"]


def test_validation_errors_name_the_field() -> None:
    assert search.call(search.validate('{"query": "x", "limit": 2}')) == ["x", "x"]
    with pytest.raises(ToolArgumentsInvalid, match="limit"):
        search.validate({"query": "x", "limit": "many"})
    with pytest.raises(ToolArgumentsInvalid, match="not JSON"):
        search.validate("{oops")
    with pytest.raises(ToolArgumentsInvalid):
        search.validate({"query": "x", "extra": 1})


def test_async_tool_and_timeout() -> None:
    @tool(timeout=0.05, name="nap")
    async def sleeper(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "rested"

    assert sleeper.is_async and sleeper.name == "nap"
    assert sleeper.call(sleeper.validate({"seconds": 0})) == "rested"
    with pytest.raises(ToolTimeout):
        sleeper.call(sleeper.validate({"seconds": 1}))


def test_sync_tool_timeout_runs_in_a_thread() -> None:
    import time

    @tool(timeout=0.05)
    def block(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    with pytest.raises(ToolTimeout):
        block.call(block.validate({"seconds": 0.5}))


# ---- a hung tool ---------------------------------------------------------------------------------------
HUNG_SCENARIO = """
import asyncio, threading
from freetoken_agents import Agent, RetryPolicy, ToolRetryExhausted, ToolTimeout, tool
from freetoken_agents.testing import ScriptedModel, ToolCall
from freetoken_agents.tools import abandoned_calls

forever = threading.Event()

@tool(timeout=0.2)
def hang() -> str:
    "Never returns."
    forever.wait()

@tool
def healthy(n: int) -> int:
    "Twice n."
    return 2 * n

async def main() -> None:
    # More hung calls than the old shared pool had threads (8), all still blocked in their threads.
    hung = await asyncio.gather(*(hang.acall(hang.validate({})) for _ in range(10)), return_exceptions=True)
    assert all(isinstance(e, ToolTimeout) for e in hung), hung
    twice = await asyncio.gather(*(healthy.acall(healthy.validate({"n": i})) for i in range(20)))
    assert twice == [2 * i for i in range(20)], twice

    retry = RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
    try:
        await Agent(ScriptedModel([ToolCall("hang")]), [hang], retry=retry).arun("hang")
        raise AssertionError("the hung tool did not time out")
    except ToolRetryExhausted:
        pass
    script = [ToolCall("healthy", {"n": i}) for i in range(20)] + ["all done"]
    result = await Agent(ScriptedModel(script), [healthy], max_steps=21).arun("twenty calls")
    assert [c.result for c in result.trace.tool_calls] == [2 * i for i in range(20)]
    assert result.output == "all done"
    print("healthy calls ok; hung threads still running:", abandoned_calls())

asyncio.run(main())
"""


def test_a_hung_tool_starves_no_other_call_and_the_process_still_exits(tmp_path) -> None:
    """The bug: sync tools shared an 8-thread pool, so hung calls used it up (a healthy call then
    timed out or hung) and the pool's threads kept the interpreter from exiting. Each call now
    has a daemon thread of its own. The bound below is only a hang guard, not a speed target."""
    script = tmp_path / "hung_tool.py"
    script.write_text(textwrap.dedent(HUNG_SCENARIO))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "healthy calls ok; hung threads still running: 13" in done.stdout  # 10 + 3 tries


# ---- tools in a process of their own ---------------------------------------------------------------------
@tool(process=True, timeout=60)
def worker_pid() -> int:
    """The id of the process the tool runs in."""
    return os.getpid()


@tool(process=True, timeout=0.5)
def spin() -> None:
    """Never returns (spins)."""
    while True:
        pass


@tool(process=True, timeout=60)
def refuse(reason: str) -> None:
    """Always fails."""
    raise ValueError(reason)


def test_a_process_tool_runs_elsewhere_is_killed_at_its_timeout_and_reports_errors() -> None:
    assert worker_pid.call(worker_pid.validate({})) != os.getpid()
    with pytest.raises(ToolTimeout):
        spin.call(spin.validate({}))
    assert multiprocessing.active_children() == []  # the spinning process was killed and reaped
    with pytest.raises(ValueError, match="no reason"):
        refuse.call(refuse.validate({"reason": "no reason"}))


def test_a_timed_out_tool_process_is_joined_by_one_thread_only(monkeypatch) -> None:
    """Regression (failed 1 of 2 full-suite runs on a busy machine): after a timeout's kill, the
    abandoned result thread saw EOF and joined the process while the caller joined it too; two
    threads in waitpid let the caller's join return before the child was reaped, so it still
    showed in `active_children()`. Each join is slowed here so two would overlap."""
    inside, most = [0], [0]
    guard = threading.Lock()
    real_join = multiprocessing.process.BaseProcess.join

    def slow_join(self, timeout=None):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.3)
        try:
            return real_join(self, timeout)
        finally:
            with guard:
                inside[0] -= 1

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", slow_join)
    with pytest.raises(ToolTimeout):
        spin.call(spin.validate({}))
    time.sleep(0.5)  # the abandoned result thread has seen EOF by now
    assert most[0] == 1
    assert multiprocessing.active_children() == []


def test_a_process_tool_must_be_a_module_level_sync_function() -> None:
    with pytest.raises(TypeError, match="module's top level"):

        @tool(process=True)
        def local() -> None:
            "Defined inside a function: a process cannot import it."

    with pytest.raises(TypeError, match="sync function"):

        @tool(process=True)
        async def later() -> None:
            "Async."


# ---- results capped before tokenisation --------------------------------------------------------------------
def test_result_text_cuts_long_results_with_a_note() -> None:
    assert result_text("short", 10) == "short"
    mixed = {"a": [1, 2.5, None, True, "é"], 1: 2}
    assert result_text(mixed, 100) == json.dumps(mixed, ensure_ascii=False)  # as before, when short
    cut = result_text("x" * 50_000_000, 1000)
    assert (
        cut
        == "x" * 1000 + "\n[truncated: the result had 50,000,000 characters; only the first 1,000 are shown]"
    )
    words = result_text(" ".join(["word"] * 10_000_000), 2000)  # 50 MB of words
    assert words.startswith("word word") and "49,999,999 characters" in words
    listed = result_text(list(range(1_000_000)), 50)
    assert listed.startswith("[0, 1, 2, 3") and "more than 50 characters" in listed
    assert default_result_chars(None) == 16_000 and default_result_chars(1024) == 1024


def test_capping_a_huge_structure_allocates_in_proportion_to_the_cap() -> None:
    big = {f"key {i}": "v" * 100 for i in range(200_000)}  # ~23 MB as JSON
    tracemalloc.start()
    try:
        text = result_text(big, 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert text.startswith('{"key 0": "vvv') and "more than 4,096 characters" in text
    assert peak < 512 * 1024  # json.dumps would have built the whole 23 MB string


def test_an_agent_hands_the_model_a_capped_result() -> None:
    @tool
    def dump() -> str:
        "A very long result."
        return "x" * 50_000_000

    model = ScriptedModel([ToolCall("dump"), "ok"])
    result = Agent(model, [dump], max_result_chars=5000).run("dump it")
    (call,) = result.trace.tool_calls
    # the trace keeps no more than the model read: the capped text, with its note
    assert call.result == call.content == result_text("x" * 50_000_000, 5000)
    seen = model.contexts[1]  # what the model read before its answer
    assert "x" * 5000 + "\n[truncated: the result had 50,000,000 characters" in seen
    assert len(seen) < 5000 + 1000
    tool_message = next(m for m in result.messages if m["role"] == "tool")
    assert tool_message["content"] == call.content


def test_a_huge_result_reaches_the_embedded_model_capped_to_its_context() -> None:
    """The bug: 50 MB of words took minutes and GBs to reach ContextOverflowError; "x" * 50M never
    did. Capped at a quarter of the context (~4 characters a token) first, it reaches the model."""

    @tool
    def dump() -> str:
        "A very long result."
        return "x" * 50_000_000

    model = FreeTokenModel.from_pretrained(default_model())
    agent = Agent(model, [dump], tool_choice="dump", max_new_tokens=4, max_steps=2)
    assert agent.max_result_chars == model.max_context  # 1024 tokens x 0.25 x 4 characters
    try:
        result = agent.run("dump it")
    except ContextOverflowError as e:  # allowed: the capped text may still be too many tokens
        assert "exceed the model's context" in str(e)
    else:
        (call,) = result.trace.tool_calls
        assert call.content == result_text(call.result, model.max_context)
