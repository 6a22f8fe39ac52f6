"""Threads and event loops: synchronous entry points over async code, the turn gate of a shared
model, and the worker thread that runs a model's steps.

`asyncio.run` refuses to start inside a running loop (Jupyter, an async web handler), and so does
`loop.run_until_complete` on a second loop in the same thread. There the coroutine gets a private
loop on a worker thread and the caller blocks on it; elsewhere it runs in the caller's thread.

`TurnGate`: one holder at a time, first come first served, for waiters of any kind at once:
threads block on it, asyncio tasks (on any event loop) await it without taking a thread, so
however many runs wait, no executor fills up and the holder always gets to finish.

`step_worker(owner)`: the one thread that runs every model step of `owner` (for FreeTokenModel,
its engine), for every front end: the Agent's runs, ChatFreeToken's calls and the server's jobs.
Steps of concurrent runs interleave there one at a time, each a short job, and the SDK's
per-token work (tokenizer, grammar masks, sampling) never runs in two threads at once.
`run_on` / `iterate_on` / `aiterate_on` run a call or each step of a generator there (inline when
the caller already is that thread).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def loop_running() -> bool:
    """True when the calling thread is running an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion and return its result (raising its exception)."""
    if not loop_running():
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="freetoken-run") as pool:
        return pool.submit(asyncio.run, coro).result()


def iterate_sync(agen: AsyncIterator[T]) -> Iterator[T]:
    """Iterate `agen` on a private event loop; closing this iterator closes `agen`."""
    loop = asyncio.new_event_loop()
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="freetoken-stream")

    def drive(coro: Coroutine[Any, Any, Any]) -> Any:
        if loop_running():
            return pool.submit(loop.run_until_complete, coro).result()
        return loop.run_until_complete(coro)

    try:
        while True:
            try:
                yield drive(agen.__anext__())  # type: ignore[arg-type]
            except StopAsyncIteration:
                return
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            drive(aclose())
        pool.shutdown()
        loop.close()


_Waiter = threading.Event | tuple[asyncio.AbstractEventLoop, asyncio.Future]


class TurnGate:
    """A FIFO lock for threads (`acquire`) and asyncio tasks on any loop (`acquire_async`).

    `release` hands the gate straight to the oldest waiter, so a stream of newcomers cannot
    overtake it. An async waiter cancelled while waiting leaves the queue (or, if the gate was
    handed to it in the same instant, passes it on): a cancelled run never keeps the gate."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def held(self) -> bool:
        return self._held

    def acquire(self) -> None:
        """Block the calling thread until the gate is its own."""
        with self._mutex:
            if not self._held:
                self._held = True
                return
            event = threading.Event()
            self._waiters.append(event)
        event.wait()  # set by release(): the gate is ours, still marked held

    async def acquire_async(self) -> None:
        """Wait (without blocking the loop or taking a thread) until the gate is the task's own."""
        loop = asyncio.get_running_loop()
        with self._mutex:
            if not self._held:
                self._held = True
                return
            waiter = (loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter[1]
        except asyncio.CancelledError:
            with self._mutex:
                queued = waiter in self._waiters
                if queued:
                    self._waiters.remove(waiter)
            if not queued and waiter[1].done() and not waiter[1].cancelled():
                self.release()  # handed over just as we were cancelled: pass it on
            raise  # (handed over but not yet delivered: `_deliver` sees the cancel and passes it on)

    def release(self) -> None:
        """Hand the gate to the oldest waiter, or open it."""
        with self._mutex:
            while self._waiters:
                waiter = self._waiters.popleft()
                if isinstance(waiter, threading.Event):
                    waiter.set()
                    return
                loop, future = waiter
                try:
                    loop.call_soon_threadsafe(self._deliver, future)
                    return
                except RuntimeError:  # its loop is closed: that waiter is gone
                    continue
            self._held = False

    def _deliver(self, future: asyncio.Future) -> None:
        if future.cancelled():
            self.release()
        else:
            future.set_result(None)


class _PerOwner(Generic[T]):
    """One T per owner object, made on first use and forgotten with the owner (owners that cannot
    be weakly referenced or hashed are kept by id, for the life of the process)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._weak: weakref.WeakKeyDictionary[Any, T] = weakref.WeakKeyDictionary()
        self._by_id: dict[int, tuple[Any, T]] = {}
        self._lock = threading.Lock()

    def __call__(self, owner: Any) -> T:
        with self._lock:
            try:
                found = self._weak.get(owner)
                if found is None:
                    found = self._weak[owner] = self._make()
                return found
            except TypeError:
                kept = self._by_id.setdefault(id(owner), (owner, self._make()))
                return kept[1]


turn_gate: Callable[[Any], TurnGate] = _PerOwner(TurnGate)
"""turn_gate(owner): the one TurnGate of `owner`."""


class _ThreadRole(threading.local):
    worker: concurrent.futures.Executor | None = None  # the step worker this thread is, if any


_role = _ThreadRole()


def _new_step_worker() -> concurrent.futures.ThreadPoolExecutor:
    box: list[concurrent.futures.ThreadPoolExecutor] = []

    def mark() -> None:
        _role.worker = box[0]

    box.append(
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="freetoken-model", initializer=mark)
    )
    return box[0]


step_worker: Callable[[Any], concurrent.futures.ThreadPoolExecutor] = _PerOwner(_new_step_worker)
"""step_worker(owner): the one worker thread that runs `owner`'s model steps (its thread ends when
the owner is garbage)."""


def run_on(worker: concurrent.futures.Executor, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on `worker`, waited for; inline when the calling thread is that worker (a step
    that calls the model again must not wait on itself)."""
    if _role.worker is worker:
        return fn(*args)
    return worker.submit(fn, *args).result()


_DONE = object()


def iterate_on(worker: concurrent.futures.Executor, steps: Generator[T, None, None]) -> Iterator[T]:
    """The items of `steps`, each `next()` run on `worker`; closing this iterator closes `steps`
    there too (its cleanup is a step like the others)."""
    try:
        while (item := run_on(worker, next, steps, _DONE)) is not _DONE:
            yield item  # type: ignore[misc]
    finally:
        run_on(worker, steps.close)


async def aiterate_on(
    worker: concurrent.futures.Executor, steps: Generator[T, None, None]
) -> AsyncIterator[T]:
    """`iterate_on` for async callers: the loop keeps running while a step runs on `worker`, and no
    thread waits for the steps of another call. Closing (or cancelling) it closes `steps` on the
    worker once its current step is done."""
    loop = asyncio.get_running_loop()
    try:
        while (item := await loop.run_in_executor(worker, next, steps, _DONE)) is not _DONE:
            yield item  # type: ignore[misc]
    finally:
        await asyncio.shield(asyncio.wrap_future(worker.submit(steps.close)))
