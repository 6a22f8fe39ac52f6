"""The CUDA side of the tiered expert memory: pinned tier 2, side-stream copies, event timing.

- Tier 2 holds decoded experts packed into one page-locked (pinned) host buffer each
  (`weights.pinned_storage`), so the host->device copy can be asynchronous.
- `CopyEngine.start` issues `dst.copy_(src, non_blocking=True)` on a side stream, timed by CUDA
  events that the host->fast `BandwidthOracle` folds in once they completed (no synchronising
  wait on the hot path); `ready` makes the compute stream wait on the copy's end event and tells
  the caching allocator that the buffer is used there (`record_stream`).
- `ComputeTimer` brackets tier-1 expert compute with events and feeds the measured seconds to
  the q* `ComputeCostModel` when they are known.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..experts import ExpertWeights
from .oracle import BandwidthOracle, cuda_timed_copy
from .policy import ComputeCostModel
from .weights import rebase


class CopyEngine:
    """Host (pinned) -> device copies of packed experts on a side stream."""

    def __init__(self, device: torch.device, link: BandwidthOracle) -> None:
        self.device, self.link = device, link
        self.stream = torch.cuda.Stream(device)
        self.bytes_copied = 0
        self._lock = threading.Lock()

    def start(self, host_value: ExpertWeights) -> tuple[ExpertWeights, Any]:
        """Start the copy; returns the device weights (not yet safe to read) and the copy's end
        event. The device buffer is allocated on the side stream, so the caching allocator orders
        its reuse after the copy."""
        src = host_value.storage
        if src is None:
            raise ValueError("CopyEngine.start needs a packed expert (one pinned storage)")
        with torch.cuda.stream(self.stream):
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        done = cuda_timed_copy(self.link, dst, src, self.stream)
        with self._lock:
            self.bytes_copied += src.numel() * src.element_size()
        return rebase(host_value, dst), done

    def ready(self, w: ExpertWeights, done: Any) -> ExpertWeights:
        """Make the current (compute) stream wait for the copy event; keep the buffer alive there."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        if w.storage is not None:
            w.storage.record_stream(stream)
        return w


class ComputeTimer:
    """Event-timed expert compute on the device, folded into `compute` when finished."""

    def __init__(self, compute: ComputeCostModel, device_name: str) -> None:
        self.compute, self.device_name = compute, device_name
        self._pending: list[tuple[Any, Any, int]] = []

    def start(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, start: Any, tokens: int, experts: int = 1) -> None:
        """End a timing of `experts` experts of `tokens` tokens each (each is credited an equal
        share: a layer whose routed experts are all resident is timed once)."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end, tokens, experts))

    def poll(self) -> None:
        """Fold in finished timings (non-blocking)."""
        still = []
        for start, end, t, n in self._pending:
            if end.query():
                share = start.elapsed_time(end) / 1e3 / n
                for _ in range(n):
                    self.compute.observe(self.device_name, "decoded", t, share)
            else:
                still.append((start, end, t, n))
        self._pending = still
