"""How a tool call runs (see `tools`): a sync tool on a daemon thread of its own, an async tool on
an event loop of its own on such a thread, a `process=True` tool in a fresh spawned process. A
BaseException that is not an Exception, raised by the tool itself there (or a process that ends
without a result), comes back as ToolAborted, so it cannot end the host program."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import logging
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

from .errors import ToolAborted

logger = logging.getLogger(__name__)

_abandoned: set[threading.Thread] = set()  # threads of timed-out calls still running
_abandoned_lock = threading.Lock()


def abandoned_calls() -> int:
    """Tool calls that timed out (or whose run was cancelled) and whose threads still run."""
    with _abandoned_lock:
        return sum(1 for t in _abandoned if t.is_alive())


def _aborted(name: str, arguments: Any, error: BaseException) -> ToolAborted:
    aborted = ToolAborted(name, arguments, error)
    aborted.__cause__ = error
    return aborted


async def run_in_thread(fn: Callable[..., Any], kwargs: dict[str, Any], name: str, tool: bool = False) -> Any:
    """`fn(**kwargs)` on a fresh daemon thread (with the caller's context variables). If the
    caller stops waiting (a timeout, a cancelled run) the thread runs on, abandoned. `tool`: `fn`
    is the tool itself, so a BaseException it raises is the tool's own: it becomes ToolAborted."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, context.run(fn, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who decides
            outcome = (False, _aborted(name, kwargs, e) if tool and not isinstance(e, Exception) else e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the caller's loop is closed: nobody waits for this result
            pass
        with _abandoned_lock:
            _abandoned.discard(threading.current_thread())

    thread = threading.Thread(target=work, name=f"freetoken-tool-{name}", daemon=True)
    thread.start()
    try:
        return await future
    except asyncio.CancelledError:
        if thread.is_alive():
            with _abandoned_lock:
                _abandoned.add(thread)
            logger.warning("tool '%s' was abandoned while still running (its thread runs on)", name)
        raise


async def run_async_in_thread(fn: Callable[..., Any], kwargs: dict[str, Any], name: str) -> Any:
    """`await fn(**kwargs)` on an event loop of its own on a fresh daemon thread (`run_in_thread`):
    a tool blocking its loop stalls only that thread. If the caller stops waiting, the tool's
    task is cancelled in its loop (it stops at its next await; until then its thread runs on)."""
    lock = threading.Lock()
    state: dict[str, Any] = {"cancelled": False, "cancel": None}

    def run_loop() -> Any:
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(fn(**kwargs))  # in this thread's context: the caller's copy
            with lock:
                if state["cancelled"]:
                    task.cancel()
                state["cancel"] = lambda: loop.call_soon_threadsafe(task.cancel)
            return loop.run_until_complete(task)
        finally:
            with lock:
                state["cancel"] = None
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    try:
        return await run_in_thread(run_loop, {}, name, tool=True)
    except asyncio.CancelledError:
        with lock:
            state["cancelled"] = True
            if state["cancel"] is not None:
                state["cancel"]()
        raise


async def run_in_process(fn: Callable[..., Any], kwargs: dict[str, Any], name: str) -> Any:
    """`fn(**kwargs)` in a fresh spawned process, killed if the caller stops waiting."""
    spawn = multiprocessing.get_context("spawn")
    receiver, sender = spawn.Pipe(duplex=False)
    target = (fn.__module__, fn.__qualname__)
    process = spawn.Process(
        target=_process_main, args=(*target, kwargs, sender), name=f"freetoken-tool-{name}", daemon=True
    )
    process.start()
    sender.close()  # the child holds its own end: EOF here when it exits

    def receive() -> tuple[bool, Any] | None:
        try:
            return receiver.recv()
        except EOFError:  # it exited without a result; only the `finally` below joins it: two
            return None  # threads in waitpid let one return before the child is reaped

    try:
        outcome = await run_in_thread(receive, {}, f"{name}-result")
    finally:
        if process.is_alive():
            process.kill()
        await run_in_thread(process.join, {}, f"{name}-join")
        receiver.close()
    if outcome is None:  # sys.exit/os._exit before the result was sent, or a crash
        died = ChildProcessError(f"the tool's process exited with code {process.exitcode} without a result")
        raise _aborted(name, kwargs, died)
    ok, value = outcome
    if ok:
        return value
    if not isinstance(value, Exception):  # SystemExit, KeyboardInterrupt... raised in the child
        raise _aborted(name, kwargs, value)
    raise value


def _process_main(module: str, qualname: str, kwargs: dict[str, Any], sender: Any) -> None:
    """A tool process: import the tool by name, run it, send (ok, result or error) back."""
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        fn = getattr(found, "fn", found)  # a Tool or its function
        outcome: tuple[bool, Any] = (True, fn(**kwargs))
    except BaseException as e:  # noqa: BLE001 - sent to the caller, who decides
        outcome = (False, e)
    try:
        sender.send(outcome)
    except Exception as e:  # noqa: BLE001 - an unpicklable result or error: say what it was
        sender.send(
            (
                False,
                RuntimeError(f"the tool's {'result' if outcome[0] else 'error'} cannot be sent back: {e}"),
            )
        )
    sender.close()
