"""Tools that misbehave cannot take down the agent: a tool (or a process tool's child) that exits,
raises KeyboardInterrupt or dies fails its call (ToolAborted) instead of ending the host; every
call has a timeout by default; an async tool blocking its loop stalls only its own thread; tool
names are valid and unique. The timeouts below are hang guards, never speed targets."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

import pytest

from freetoken_agents import (
    Agent,
    DuplicateToolName,
    InvalidToolName,
    RetryPolicy,
    Tool,
    ToolAborted,
    ToolExecutionError,
    ToolRetryExhausted,
    ToolTimeout,
    tool,
    tools,
)
from freetoken_agents.testing import ScriptedModel, ToolCall
from freetoken_agents.tools import DEFAULT_TOOL_TIMEOUT, UNSET, default_tool_timeout

FAST = RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
GUARD = 120  # seconds: only so that a regression hangs no longer than this


def run_guarded(fn, *args):
    """`fn(*args)` on a daemon thread; (returned, value or error). Not returning within GUARD
    seconds fails the test (the bug: a hang) instead of hanging the suite."""
    out: list = []

    def target() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - SystemExit included: the test inspects it
            out.append((False, e))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(GUARD)
    assert out, "the call did not return (hung)"
    return out[0]


# ---- a tool that does not return ---------------------------------------------------------------------
@tool
def bye(code: int) -> str:
    "Exits the program."
    sys.exit(code)


@tool
def interrupt() -> str:
    "Raises KeyboardInterrupt itself."
    raise KeyboardInterrupt


@tool
async def async_bye() -> str:
    "An async tool that exits."
    sys.exit(2)


@pytest.mark.parametrize(
    ("t", "arguments", "original"),
    [(bye, {"code": 3}, SystemExit), (interrupt, {}, KeyboardInterrupt), (async_bye, {}, SystemExit)],
)
def test_a_tool_that_exits_fails_its_call_and_the_run_goes_on(t: Tool, arguments: dict, original) -> None:
    model = ScriptedModel([ToolCall(t.name, arguments), "recovered"])
    ok, value = run_guarded(Agent(model, [t], retry=FAST).run, "go")
    assert ok, f"{type(value).__name__} escaped agent.run: {value!r}"
    assert value.output.endswith("recovered")  # after the failure note it kept
    (failed,) = value.trace.retries
    assert failed.scope == "model" and failed.error_type == "ToolAborted" and failed.tool == t.name
    assert original.__name__ in failed.error
    assert original.__name__ in model.contexts[1]  # the note the model read after the rollback


def test_tool_aborted_is_a_tool_execution_error_naming_the_tool() -> None:
    with pytest.raises(ToolAborted) as info:
        asyncio.run(bye.acall(bye.validate({"code": 3})))
    assert isinstance(info.value, ToolExecutionError) and info.value.tool == "bye"
    assert isinstance(info.value.error, SystemExit) and info.value.error.code == 3
    assert info.value.__cause__ is info.value.error and "SystemExit" in str(info.value)


def test_a_tool_that_always_exits_ends_the_run_with_an_agent_error() -> None:
    model = ScriptedModel([ToolCall("bye", {"code": 1})] * 2)
    ok, value = run_guarded(Agent(model, [bye], retry=RetryPolicy(model_attempts=2)).run, "go")
    assert not ok and isinstance(value, ToolRetryExhausted)
    assert [a.error_type for a in value.attempts] == ["ToolAborted"] * 2


def test_a_ctrl_c_of_the_host_still_stops_the_run() -> None:
    """Only what the tool raised is converted: a KeyboardInterrupt delivered to the host's main
    thread (here a real SIGINT sent to it while a tool runs) still ends agent.run with
    KeyboardInterrupt. Not `_thread.interrupt_main()`: it only sets a flag, which a main thread
    already asleep in its event loop's select() reads when something else wakes it (the tool's
    60 s timeout: the test then failed in 2 of 3 full-suite runs); a signal wakes the select()."""
    release = threading.Event()

    @tool
    def waits() -> str:
        "Waits; meanwhile the user presses Ctrl-C."
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        release.wait(GUARD)
        return "done"

    model = ScriptedModel([ToolCall("waits"), "finished"])
    try:
        with pytest.raises(KeyboardInterrupt):
            Agent(model, [waits], retry=FAST).run("go")
    finally:
        release.set()


# ---- a process tool's child that exits or dies (module level: the child imports them) -------------------
@tool(process=True)
def child_exits() -> str:
    "Calls sys.exit(3) in the tool's process."
    sys.exit(3)


@tool(process=True)
def child_dies() -> str:
    "Calls os._exit(1): the process ends without a result."
    os._exit(1)


@tool(process=True)
def child_interrupted() -> str:
    "Raises KeyboardInterrupt in the tool's process."
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("t", "original", "detail"),
    [
        (child_exits, SystemExit, "3"),
        (child_dies, ChildProcessError, "exited with code 1"),
        (child_interrupted, KeyboardInterrupt, ""),
    ],
)
def test_a_process_tool_whose_child_exits_or_dies_fails_its_call(t: Tool, original, detail: str) -> None:
    ok, value = run_guarded(lambda: asyncio.run(t.acall(t.validate({}))))
    assert not ok and isinstance(value, ToolAborted), repr(value)
    assert isinstance(value.error, original) and detail in str(value) and value.tool == t.name


def test_an_agent_survives_a_process_tool_calling_sys_exit() -> None:
    model = ScriptedModel([ToolCall("child_exits"), "recovered"])
    ok, value = run_guarded(Agent(model, [child_exits], retry=FAST).run, "go")
    assert ok and value.output.endswith("recovered"), repr(value)
    assert [r.error_type for r in value.trace.retries] == ["ToolAborted"]


# ---- timeouts by default --------------------------------------------------------------------------------
def test_a_tool_without_a_timeout_gets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFAULT_TOOL_TIMEOUT == 60.0
    monkeypatch.setattr(tools, "DEFAULT_TOOL_TIMEOUT", 0.2)
    never = threading.Event()

    @tool
    def hang() -> str:
        "Waits on an event nobody sets."
        never.wait()
        return "never"

    retry = RetryPolicy(tool_attempts=1, initial_backoff=0.0)
    try:
        ok, value = run_guarded(Agent(ScriptedModel([ToolCall("hang")]), [hang], retry=retry).run, "go")
    finally:
        never.set()
    assert not ok and isinstance(value, ToolRetryExhausted), repr(value)
    assert isinstance(value.__cause__, ToolTimeout) and value.attempts[0].error_type == "ToolTimeout"


def test_the_agents_tool_timeout_applies_to_tools_without_their_own() -> None:
    never = threading.Event()

    @tool
    def hang() -> str:
        "Waits on an event nobody sets."
        never.wait()
        return "never"

    retry = RetryPolicy(tool_attempts=1, initial_backoff=0.0)
    agent = Agent(ScriptedModel([ToolCall("hang")]), [hang], retry=retry, tool_timeout=0.2)
    try:
        ok, value = run_guarded(agent.run, "go")
    finally:
        never.set()
    assert not ok and isinstance(value.__cause__, ToolTimeout), repr(value)


def test_timeout_precedence_and_validation() -> None:
    own = Tool(lambda: 1, name="own", timeout=5)
    unset, off = Tool(lambda: 1, name="unset"), Tool(lambda: 1, name="off", timeout=None)
    assert (own.effective_timeout(), unset.effective_timeout(), off.effective_timeout()) == (5, 60, None)
    with default_tool_timeout(0.5):  # what an Agent's tool_timeout sets for its run
        assert (own.effective_timeout(), unset.effective_timeout(), off.effective_timeout()) == (5, 0.5, None)
    with default_tool_timeout(None):
        assert unset.effective_timeout() is None
    assert unset.timeout is UNSET and unset.effective_timeout() == 60
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match="positive number of seconds"):
            Tool(lambda: 1, name="t", timeout=bad)
        with pytest.raises(ValueError, match="tool_timeout"):
            Agent(ScriptedModel([]), [], tool_timeout=bad)


# ---- an async tool that blocks its loop -----------------------------------------------------------------
def test_an_async_tool_blocking_its_loop_times_out_and_the_callers_loop_runs_on() -> None:
    entered, finished, release = threading.Event(), threading.Event(), threading.Event()

    @tool(timeout=0.2)
    async def blocker() -> str:
        "Blocks its event loop (time.sleep in an async def)."
        entered.set()
        release.wait(10)  # a blocking wait: no await
        finished.set()
        return "late"

    async def main() -> list[bool]:
        ticks: list[bool] = []  # per tick of this loop: was the tool blocked in its thread then?
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks.append(entered.is_set() and not finished.is_set())
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        try:
            with pytest.raises(ToolTimeout):
                await blocker.acall(blocker.validate({}))
        finally:
            stop.set()
            await ticking
        return ticks

    try:
        ticks = asyncio.run(main())
    finally:
        release.set()
    assert any(ticks)  # the caller's loop ran while the tool blocked


def test_an_async_tool_sees_context_variables_and_is_cancelled_at_its_timeout() -> None:
    import contextvars

    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="unset")
    cancelled = threading.Event()

    @tool(timeout=0.2)
    async def sleepy() -> str:
        "Awaits for long; sees the caller's context."
        seen.append(request_id.get())
        try:
            await asyncio.sleep(GUARD)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    seen: list[str] = []

    async def main() -> None:
        request_id.set("r-1")
        with pytest.raises(ToolTimeout):
            await sleepy.acall(sleepy.validate({}))

    asyncio.run(main())
    assert seen == ["r-1"] and cancelled.wait(GUARD)


# ---- tool names ---------------------------------------------------------------------------------------
def test_tool_names_must_be_identifiers() -> None:
    for bad in ("get weather", "", "1st", "x" * 65, "naïve", "a/b", "<lambda>"):
        with pytest.raises(InvalidToolName, match="invalid tool name"):
            Tool(lambda: 1, name=bad)
    with pytest.raises(InvalidToolName, match="lambda"):
        tool(lambda: 1)  # a lambda's name is "<lambda>": give it a name
    for good in ("get_weather", "_private", "ns.get-weather2", "x" * 64):
        assert Tool(lambda: 1, name=good).name == good
    assert issubclass(InvalidToolName, ValueError)


def test_duplicate_tool_names_are_an_error_not_dropped() -> None:
    first, second = Tool(lambda: 1, name="lookup"), Tool(lambda: 2, name="lookup")
    with pytest.raises(DuplicateToolName, match="two tools are named 'lookup'"):
        Agent(ScriptedModel([]), [first, second])
    renamed = Tool(lambda: 3, name="other")
    renamed.name = "not valid"  # changed after it was made
    with pytest.raises(InvalidToolName, match="not valid"):
        Agent(ScriptedModel([]), [first, renamed])


def test_abandoned_async_threads_end_when_cancelled() -> None:
    """An async tool's thread ends once its task sees the cancellation (no thread is kept)."""
    before = threading.active_count()

    @tool(timeout=0.1)
    async def nap() -> str:
        "Sleeps cooperatively."
        await asyncio.sleep(GUARD)
        return "late"

    for _ in range(5):
        with pytest.raises(ToolTimeout):
            asyncio.run(nap.acall(nap.validate({})))
    deadline = time.monotonic() + GUARD  # a hang guard, not a speed target
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
