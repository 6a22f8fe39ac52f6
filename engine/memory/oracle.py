"""Measured bandwidth per link (storage->host, host->fast), robust to outliers, quick to follow
a real change.

`BandwidthOracle.estimate()` is the median of the inlier rates in a rolling window. A sample is an
outlier when it lies more than `k_mad` scaled MADs (and at least `rel_tol` of the median) from
the window's median; a single outlier is kept out of the estimate. When `confirm` consecutive
samples are outliers on the same side, or at least two that together took `confirm_s` (0.2 s),
bandwidth has changed: the window restarts from them. So a step change is followed within
300 ms of transfers whenever one transfer takes <= 150 ms (one lone slow sample is always
treated as an outlier: it cannot be told apart from a stall).

Timing: CPU transfers with the injectable `clock` (default `time.monotonic`) around the copy;
CUDA copies with events recorded on the copy stream, folded in by `poll()` once they completed
(never a synchronising wait on the hot path). `ThrottledLink` + `ManualClock` drive it in tests.
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

Clock = Callable[[], float]


class BandwidthOracle:
    """Bandwidth estimate of one link in bytes/s from timed transfers.

    Args:
        name: link name for stats/logs, e.g. "storage->host".
        window: samples kept.
        clock: seconds, monotonic (injectable).
        prior_bps: estimate before any sample (None: `estimate()` returns None).
    """

    def __init__(
        self,
        name: str,
        *,
        window: int = 32,
        clock: Clock = time.monotonic,
        prior_bps: float | None = None,
        k_mad: float = 4.0,
        rel_tol: float = 0.25,
        confirm: int = 3,
        confirm_s: float = 0.2,
        history: int = 256,
    ) -> None:
        self.name, self.clock, self.prior_bps = name, clock, prior_bps
        self.k_mad, self.rel_tol, self.confirm, self.confirm_s = k_mad, rel_tol, confirm, confirm_s
        self._suspect_s = 0.0
        self._rates: deque[float] = deque(maxlen=window)
        # The window's rates in ascending order, kept beside it: the median is read off it on every
        # sample (a q* promotion records one; `statistics.median` sorted the window each time).
        self._sorted: list[float] = []
        self._suspects: list[float] = []
        self._estimate: float | None = prior_bps
        self.samples = 0
        self.outliers = 0
        self.changes = 0
        self.bytes_total = 0
        self.seconds_total = 0.0
        self.history: deque[tuple[float, float]] = deque(maxlen=history)  # (clock s, bytes/s)
        self._pending_cuda: list[tuple[Any, Any, int]] = []
        self._pending_lock = threading.Lock()  # loader threads queue copies while compute polls

    # ---- samples --------------------------------------------------------------------------
    def record(self, nbytes: int, seconds: float) -> None:
        """Fold in one transfer of `nbytes` that took `seconds` (> 0; others are ignored)."""
        if seconds <= 0 or nbytes <= 0:
            return
        self.samples += 1
        self.bytes_total += nbytes
        self.seconds_total += seconds
        rate = nbytes / seconds
        # With samples, the estimate is always the window's median (set below on every change
        # of the window): no second median of the same window.
        med = self._estimate
        if len(self._rates) >= 3 and med is not None and self._is_outlier(rate, med):
            self.outliers += 1
            if self._suspects and (rate > med) != (self._suspects[-1] > med):
                self._suspects, self._suspect_s = [], 0.0
            self._suspects.append(rate)
            self._suspect_s += seconds
            n = len(self._suspects)
            if n >= self.confirm or (n >= 2 and self._suspect_s >= self.confirm_s):
                # A run of same-side outliers is a new regime, not noise: restart the window.
                self._rates.clear()
                self._rates.extend(self._suspects)
                self._sorted = sorted(self._rates)
                self._suspects, self._suspect_s = [], 0.0
                self.changes += 1
            else:
                return
        else:
            self._suspects, self._suspect_s = [], 0.0
            if len(self._rates) == self._rates.maxlen:
                del self._sorted[bisect.bisect_left(self._sorted, self._rates[0])]
            self._rates.append(rate)
            bisect.insort(self._sorted, rate)
        self._estimate = self._median()
        self.history.append((self.clock(), self._estimate))

    def _median(self) -> float:
        ordered, n = self._sorted, len(self._sorted)
        mid = n // 2
        return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    def _is_outlier(self, rate: float, med: float) -> bool:
        """Whether `rate` lies beyond the window's spread around its median `med`."""
        off = abs(rate - med)
        if off <= self.rel_tol * med:  # inside the floor: no spread can make it an outlier
            return False
        mad = statistics.median(abs(r - med) for r in self._rates)
        return off > max(self.k_mad * 1.4826 * mad, self.rel_tol * med)

    @contextmanager
    def time_transfer(self, nbytes: int) -> Iterator[None]:
        """Time the body with `clock` as one transfer of `nbytes` (CPU-side copies and reads)."""
        t0 = self.clock()
        yield
        self.record(nbytes, self.clock() - t0)

    def record_cuda_copy(self, start: Any, end: Any, nbytes: int) -> None:
        """Queue a CUDA copy bracketed by recorded events; folded in by `poll()` when done."""
        with self._pending_lock:
            self._pending_cuda.append((start, end, nbytes))

    def poll(self) -> None:
        """Fold in the queued CUDA copies whose end event completed (non-blocking)."""
        if not self._pending_cuda:
            return
        with self._pending_lock:
            pending, self._pending_cuda = self._pending_cuda, []
        still: list[tuple[Any, Any, int]] = []
        for start, end, nbytes in pending:
            if end.query():
                self.record(nbytes, start.elapsed_time(end) / 1e3)  # ms -> s
            else:
                still.append((start, end, nbytes))
        with self._pending_lock:
            self._pending_cuda[:0] = still  # keep issue order ahead of copies queued meanwhile

    # ---- answers --------------------------------------------------------------------------
    def estimate(self) -> float | None:
        """Bytes per second (None before any sample and without a prior)."""
        self.poll()
        return self._estimate

    def seconds_for(self, nbytes: int) -> float:
        """Predicted transfer time of `nbytes` (inf when nothing is known)."""
        bw = self.estimate()
        return float("inf") if not bw else nbytes / bw

    def stats(self) -> dict[str, Any]:
        self.poll()  # finished CUDA copies count
        return {
            "estimate_bps": self._estimate,
            "samples": self.samples,
            "outliers_rejected": self.outliers,
            "changes_tracked": self.changes,
            "bytes": self.bytes_total,
            "seconds": self.seconds_total,
            "history": list(self.history)[-16:],
        }


def cuda_timed_copy(oracle: BandwidthOracle, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> Any:
    """`dst.copy_(src, non_blocking=True)` on `stream`, timed with CUDA events; returns the end
    event (wait on it with `torch.cuda.current_stream().wait_event(ev)` before using `dst`).
    `src` must be pinned host memory for the copy to be asynchronous."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    oracle.record_cuda_copy(start, end, src.numel() * src.element_size())
    return end


class ManualClock:
    """A clock tests advance by hand (seconds)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ThrottledLink:
    """A simulated link for tests: `transfer(nbytes)` advances `clock` by nbytes / bytes_per_s
    (times `jitter()` if given) inside the oracle's timing, as a real copy would take time."""

    def __init__(
        self,
        oracle: BandwidthOracle,
        clock: ManualClock,
        bytes_per_s: float,
        jitter: Callable[[], float] | None = None,
    ) -> None:
        self.oracle, self.clock, self.bytes_per_s, self.jitter = oracle, clock, bytes_per_s, jitter

    def transfer(self, nbytes: int) -> float:
        """Simulate one transfer; returns its duration in seconds."""
        dt = nbytes / self.bytes_per_s * (self.jitter() if self.jitter else 1.0)
        with self.oracle.time_transfer(nbytes):
            self.clock.advance(dt)
        return dt
