"""Compiled grammars, kept by key (least recently used dropped), compiled either where they are
asked for or on one background thread with a deadline.

An Agent compiles inline, on the thread that decodes. The server must not: its engine worker
serves every client one step at a time, and a schema compiled there held them all (a 380-byte
tool schema compiled for more than 90 s while other clients went unanswered). It compiles each
request's schemas before queueing it, with `get(..., timeout=...)`: on this cache's one compile
thread, shared by all requests (so compiles never take more than one core between them), the
caller waiting at most `timeout` s for the thread and `timeout` s for its compile. A compile
cannot be interrupted (it runs in the compiler's C++ code, which releases the GIL): past its
deadline the caller is refused and the compile goes on to fill the cache (a retry finds it). A
compile nobody waits for any more before it started is dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import GrammarCompilerBusy, SchemaRejected

logger = logging.getLogger(__name__)

__all__ = ["CompiledGrammar", "GrammarCache"]


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar and its cache key (`GrammarCache.keep` puts it back)."""

    key: str
    grammar: Any


@dataclass(eq=False)
class _Job:
    key: str
    compile: Callable[[], Any]
    waiters: int = 1
    cancelled: bool = False
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: Exception | None = None


class GrammarCache:
    """Grammars by key, at most `size` kept; thread-safe. `get` compiles what is missing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        self._jobs: dict[str, _Job] = {}  # compiles queued or running on the compile thread
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: str, compile: Callable[[], Any], timeout: float | None = None) -> Any:
        """The grammar under `key`, compiled by `compile()` when missing: on the caller's thread
        (timeout None), or on the compile thread, waiting at most `timeout` s for it to start
        and `timeout` s more for it to end. GrammarCompilerBusy when it did not start in time
        (other compiles held the thread), SchemaRejected when it did not end in time; the
        compiler's own error when it failed. A compile of `key` already under way is joined."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            job = self._jobs.get(key)
            if job is not None:
                job.waiters += 1
            elif timeout is not None:
                job = self._submit(key, compile)
        if job is None:
            grammar = compile()
            self.keep(CompiledGrammar(key, grammar))
            return grammar
        return self._wait(job, timeout)

    def keep(self, *grammars: CompiledGrammar) -> None:
        """Put compiled grammars in the cache as the most recently used (a request compiled
        before it queued needs its grammars again when it runs, after others may have pushed them
        out)."""
        with self._lock:
            for compiled in grammars:
                self._store(compiled.key, compiled.grammar)

    def _store(self, key: str, grammar: Any) -> None:
        """Cache `grammar` as the most recently used (under the lock)."""
        self._entries[key] = grammar
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:  # a server sees schemas without end
            self._entries.popitem(last=False)

    def _submit(self, key: str, compile: Callable[[], Any]) -> _Job:
        """Queue a compile (under the lock); the compile thread starts with the first."""
        job = _Job(key, compile)
        self._jobs[key] = job
        self._queue.put(job)
        if self._thread is None:
            # a daemon: a compile under way must not keep the process from exiting
            self._thread = threading.Thread(target=self._serve, name="freetoken-grammar", daemon=True)
            self._thread.start()
        return job

    def _wait(self, job: _Job, timeout: float | None) -> Any:
        try:
            if not job.started.wait(timeout):
                raise GrammarCompilerBusy(
                    f"the grammar compiler is busy with other schemas: this one did not start "
                    f"compiling within {timeout:g} s; retry"
                )
            if not job.done.wait(timeout):
                raise SchemaRejected(
                    f"the JSON schema's grammar did not compile within {timeout:g} s: simplify "
                    "the schema (fewer or shorter patterns, enums, properties)"
                )
        finally:
            with self._lock:
                job.waiters -= 1
                if not job.waiters and not job.started.is_set():  # nobody wants it any more
                    job.cancelled = True
                    self._jobs.pop(job.key, None)
        if job.error is not None:
            raise job.error
        return job.result

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            with self._lock:
                if job.cancelled:
                    continue
                job.started.set()
            try:
                job.result = job.compile()
            except Exception as e:  # the compiler's refusal goes to the waiters
                job.error = e
            with self._lock:  # at once: a `get` in between would compile it again
                self._jobs.pop(job.key, None)
                if job.error is None:
                    self._store(job.key, job.result)
            if job.error is not None:
                logger.debug("grammar compile failed: %s", job.error)
            job.done.set()
