"""The CUDA side of the tiered expert memory: pinned tier 2, side-stream copies, event timing.

- Tier 2 holds each expert's compact raw bytes (as stored: fp8, int8, MXFP4, bf16) in one
  page-locked (pinned) host buffer (`weights.pinned_raw`), or, for an expert that moved up and
  was spilled back, its decoded weights packed the same way (`weights.pinned_storage`); either
  way the host->device copy can be asynchronous.
- `CopyEngine.start` issues `dst.copy_(src, non_blocking=True)` on a side stream, timed by CUDA
  events that the host->fast `BandwidthOracle` folds in once they completed (no synchronising
  wait on the hot path); `ready` makes the compute stream wait on the copy's end event and tells
  the caching allocator that the buffer is used there (`record_stream`). Compact bytes are then
  decoded on the GPU (`TierMover._device_decode`).
- `ComputeTimer` brackets tier-1 expert compute (and device decodes) with events and feeds the
  measured seconds to the q* `ComputeCostModel` when they are known.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..model.experts import ExpertWeights
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

    def start(self, host_value: ExpertWeights | torch.Tensor) -> tuple[ExpertWeights | torch.Tensor, Any]:
        """Start the copy of a tier-2 value (pinned raw bytes, or a packed expert); returns its
        device counterpart (not yet safe to read) and the copy's end event. The device buffer is
        allocated on the side stream, so the caching allocator orders its reuse after the copy."""
        src = host_value if isinstance(host_value, torch.Tensor) else host_value.storage
        if src is None:
            raise ValueError("CopyEngine.start needs raw bytes or a packed expert (one pinned storage)")
        with torch.cuda.stream(self.stream):
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        done = cuda_timed_copy(self.link, dst, src, self.stream)
        with self._lock:
            self.bytes_copied += src.numel() * src.element_size()
        return (dst if isinstance(host_value, torch.Tensor) else rebase(host_value, dst)), done

    def ready(self, arrived: ExpertWeights | torch.Tensor, done: Any) -> ExpertWeights | torch.Tensor:
        """Make the current (compute) stream wait for the copy event; keep the buffer alive there."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        buffer = arrived if isinstance(arrived, torch.Tensor) else arrived.storage
        if buffer is not None:
            buffer.record_stream(stream)
        return arrived


class ComputeTimer:
    """Event-timed expert compute on the device, folded into `compute` when finished."""

    def __init__(self, compute: ComputeCostModel, device_name: str) -> None:
        self.compute, self.device_name = compute, device_name
        self._pending: list[tuple[Any, Any, int]] = []

    def start(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, start: Any, tokens: int, experts: int = 1, *, kind: str = "decoded") -> None:
        """End a timing of `experts` experts of `tokens` tokens each (each is credited an equal
        share: a layer whose routed experts are all resident is timed once). `kind`: the compute
        model's codec slot ("decoded" for expert compute, "decode/<codec>" for a device decode)."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end, tokens, experts, kind))

    def poll(self) -> None:
        """Fold in finished timings (non-blocking)."""
        still = []
        for start, end, t, n, kind in self._pending:
            if end.query():
                share = start.elapsed_time(end) / 1e3 / n
                for _ in range(n):
                    self.compute.observe(self.device_name, kind, t, share)
            else:
                still.append((start, end, t, n, kind))
        self._pending = still
