"""Synchronous entry points over async code that also work inside a running event loop.

`asyncio.run` refuses to start inside a running loop (Jupyter, an async web handler), and so does
`loop.run_until_complete` on a second loop in the same thread. There the coroutine gets a private
loop on a worker thread and the caller blocks on it; elsewhere it runs in the caller's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

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
