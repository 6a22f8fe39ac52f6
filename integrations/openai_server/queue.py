"""One engine, many clients: a bounded queue of jobs and the one worker thread that runs them.

Batch 1 by design: the worker owns the model backend (one engine session and its prefix cache)
and runs one request at a time, each step under `engine.lock` (held per step, never across
one). HTTP handlers never touch the engine: they submit a `Job` and read its events from an
asyncio queue the worker feeds with `call_soon_threadsafe`. A full queue refuses the job at once
(`QueueFull`, answered 429 with Retry-After). A job whose client left is cancelled: skipped if it
still waits, stopped between two decode steps if it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from freetoken_agents.sync_bridge import iterate_on

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds `max_queue` waiting jobs. `retry_after`: seconds, a guess from the mean
    job time."""

    def __init__(self, queued: int, retry_after: int) -> None:
        super().__init__(f"the server is busy: {queued} requests are waiting; retry in {retry_after}s")
        self.queued, self.retry_after = queued, retry_after


@dataclass
class JobEnd:
    """The worker's last event for a job. error: the exception that ended it, if any."""

    error: BaseException | None = None


class Job:
    """A request waiting for, or running on, the engine. The worker calls `run(job)`, a generator
    of events; each event (then a `JobEnd`) reaches `events` on the submitting loop."""

    def __init__(
        self, run: Callable[[Job], Generator[Any, None, None]], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.run = run
        self.loop = loop
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self._cancel = threading.Event()
        self._cancel_lock = threading.Lock()
        self.finish: str | None = None  # how it ended: done, error, cancelled (set by the worker)

    def cancel(self) -> bool:
        """Ask the worker to drop this job (waiting) or stop it at the next step (running).
        True the first time (so a disconnect noticed twice is counted once)."""
        with self._cancel_lock:
            first = not self._cancel.is_set()
            self._cancel.set()
        return first

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def results(self) -> AsyncIterator[Any]:
        """The job's events as they reach `events`, up to its `JobEnd`; the error that ended the
        job, if any, raised after them."""
        while not isinstance(event := await self.events.get(), JobEnd):
            yield event
        if event.error is not None:
            raise event.error

    def emit(self, event: Any) -> None:
        """Hand `event` to the job's loop (from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class WorkerStats:
    """Counters /health reports."""

    queued: int = 0
    running: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    disconnects: int = 0
    mean_seconds: float = field(default=1.0, repr=False)


class EngineWorker:
    """Admits jobs (at most `max_queue` wait behind the running one) and runs them one at a time:
    a dispatcher thread takes each job in turn and runs its steps on `steps`, the engine's step
    worker (`sync_bridge.step_worker`), the one executor every front end's model steps run on."""

    def __init__(self, steps: concurrent.futures.Executor, max_queue: int = 16) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.steps = steps
        self.max_queue = max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._stats = WorkerStats()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="freetoken-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish the running job, drop the waiting ones (cancelled), end the thread."""
        if self._thread is None:
            return
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                self._end(job, JobEnd(), "cancelled")
        self._queue.put(None)
        self._thread.join()
        self._thread = None

    # ---- clients --------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job`, or raise QueueFull at once."""
        with self._lock:
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self._stats.rejected += 1
                wait = self._stats.mean_seconds * (self._queue.qsize() + self._stats.running)
                raise QueueFull(self._queue.qsize(), max(1, math.ceil(wait))) from None
            self._stats.queued = self._queue.qsize()

    def client_left(self, job: Job) -> None:
        """The job's client disconnected: cancel the job unless it already ended."""
        if job.finish is None and job.cancel():
            with self._lock:
                self._stats.disconnects += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self._stats
            return {
                "queued": self._queue.qsize(),
                "running": s.running,
                "max_queue": self.max_queue,
                "completed": s.completed,
                "failed": s.failed,
                "cancelled": s.cancelled,
                "rejected": s.rejected,
                "disconnects": s.disconnects,
            }

    # ---- the worker -------------------------------------------------------------------------------
    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            with self._lock:
                self._stats.queued = self._queue.qsize()
            if job.cancelled:
                self._end(job, JobEnd(), "cancelled")
                continue
            with self._lock:
                self._stats.running = 1
            started = time.perf_counter()
            end, how = JobEnd(), "done"
            try:
                for event in iterate_on(self.steps, job.run(job)):
                    job.emit(event)
                if job.cancelled:
                    how = "cancelled"
            except Exception as e:  # the job's error goes to its client; the worker goes on
                logger.debug("job failed: %s", e, exc_info=True)
                end, how = JobEnd(e), "error"
            with self._lock:
                self._stats.running = 0
                elapsed = time.perf_counter() - started
                self._stats.mean_seconds = 0.8 * self._stats.mean_seconds + 0.2 * elapsed
            self._end(job, end, how)

    def _end(self, job: Job, end: JobEnd, how: str) -> None:
        job.finish = how
        with self._lock:
            counter = {"done": "completed", "error": "failed", "cancelled": "cancelled"}[how]
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        job.emit(end)
