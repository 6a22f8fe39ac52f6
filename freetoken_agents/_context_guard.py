"""One context's guard (FreeTokenModel's, `model.py`; see its docstring: Concurrency): the lock
every step holds, and the count of changes by which a turn suspended between its events finds
out, when it resumes, that another caller changed the context meanwhile (ContextConflict), rather
than continue from a context it did not write."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

from .backend import GenEvent
from .errors import ContextConflict

T = TypeVar("T")


def context_step(method: Callable[..., T]) -> Callable[..., T]:
    """A step that changes the context: it holds the context's lock and counts as a change (a
    turn suspended meanwhile raises ContextConflict when it resumes)."""

    @functools.wraps(method)
    def step(self: ContextGuard, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            self._version += 1
            return method(self, *args, **kwargs)

    return step


def context_read(method: Callable[..., T]) -> Callable[..., T]:
    """A step that leaves the token context as it is (anchors, logits): it holds the lock only."""

    @functools.wraps(method)
    def step(self: ContextGuard, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return method(self, *args, **kwargs)

    return step


class ContextGuard:
    """The lock and the change count of one context (`_open_guard` makes them anew), and turns
    advanced under them (`_guarded`). Steps are marked `context_step` or `context_read`."""

    _lock: threading.RLock
    _version: int

    def _open_guard(self) -> None:
        self._lock = threading.RLock()
        self._version = 0  # changes made to the context (see context_step)

    def _guarded(self, events: Iterator[GenEvent]) -> Generator[GenEvent, None, None]:
        """`events` (a turn) advanced under the context's lock, checking on each resume that the
        context was not changed by anyone else while the turn was suspended."""
        seen: int | None = None
        try:
            while True:
                with self._lock:
                    if seen is not None and self._version != seen:
                        raise ContextConflict(
                            "the context was changed by another caller while a turn was being "
                            "generated on it; give each conversation its own context (new_context())"
                        )
                    try:
                        event = next(events)
                    except StopIteration:
                        return
                    seen = self._version
                yield event
        finally:
            events.close()
