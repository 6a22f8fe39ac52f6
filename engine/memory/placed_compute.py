"""PlacedCompute: one routed expert computed where q* places it (`TieredExpertProvider._compute`).

Placements (per expert per step, `QStarPolicy`):
- RESIDENT: in tier 1; compute there.
- STREAM: bring it into tier 1 (reading tier 3 if needed; CPU: decode or move; CUDA: async copy
  of the compact bytes on a side stream that compute waits for by event, then a GPU decode),
  keep it there (may evict), compute there.
- HOST: compute where the weights are: CPU: from the tier-2 bytes (decoded transiently; read from
  tier 3 into tier 2 first if absent); CUDA: on the CPU from the pinned compact bytes (decoded
  there transiently), moving activations.
- STAGED (CUDA, prefetch): computed once from the prefetch's staged copy, or kept as a STREAM.
- SPLIT (CUDA, `_split_compute`): HOST, but the last share of the down projection's rows is
  copied and computed on the device.
`placement="stream"` is the mixtral-offloading design kept as a baseline: a per-layer LRU of
decoded copies in tier 1 (`LayerLRUTier` + `AlwaysStreamPolicy`), tier 2 independent of it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..model import routed
from ..model.experts import ExpertKey, ExpertWeights
from ..model.routed import expert_forward
from ..spec import MoESpec
from .planner import ExpertPlanner
from .policy import DOWN_SHARE, Placement, QStarPolicy
from .prefetch import Prefetcher
from .stats import PhaseTimer


class PlacedCompute:
    """The per-placement compute paths of `TieredExpertProvider` (a mixin: its attributes are the
    provider's)."""

    fast: Any
    moves: Any
    planner: ExpertPlanner
    policy: QStarPolicy
    prefetcher: Prefetcher | None
    phases: PhaseTimer
    codec: dict[ExpertKey, str]
    cuda: bool
    device: torch.device
    _timer: Any
    _lock: Any  # the mover's lock (`TierMover.lock`)
    _hidden_host: tuple[torch.Tensor, torch.Tensor] | None

    def _compute(self, layer: int, expert: int, x: torch.Tensor, spec: MoESpec) -> torch.Tensor:
        key = (layer, expert)
        t = x.shape[0]
        w = self.fast.get(key)
        if w is not None:  # RESIDENT is the only placement q* prices for it: no decision to make
            self.policy.count_resident(1, t)
            return self._fast_compute(w, x, spec)
        staged = None
        if self.prefetcher is not None:
            with self.phases.time("wait_prefetch"):
                staged = self.prefetcher.take(key)
        place = self.planner.decide(
            key, t, staged=staged is not None, activation_bytes=2 * x.numel() * x.element_size()
        )
        if place is Placement.HOST:
            return self._host_compute(key, x, spec, staged)
        if place is Placement.STAGED:  # computed from the prefetch's copy: let go or kept a while
            if self.planner.keeps_staged(key):
                w = self.moves.promote(key, staged, recent=True)
                self.planner.recent.observe_keep(self.moves.last_put_s)  # type: ignore[union-attr]
                return self._fast_compute(w, x, spec)
            return self._fast_compute(self.moves.use_staged(key, staged), x, spec)
        if place is Placement.SPLIT:
            return self._split_compute(key, x, spec, self.planner.take_split(key))
        return self._fast_compute(self.moves.promote(key, staged), x, spec)

    def _fast_compute(self, w: ExpertWeights, x: torch.Tensor, spec: MoESpec) -> torch.Tensor:
        """Compute one expert in tier 1, timing it for q*'s compute model."""
        t = x.shape[0]
        if self._timer is not None:
            start = self._timer.start()
            y = expert_forward(w, x, spec)
            self._timer.stop(start, t)  # folded in by poll(), no sync
            return y
        t0 = time.perf_counter()  # (not `phases.time`: a context manager's ~1.5 us, on every miss)
        y = expert_forward(w, x, spec)
        took = time.perf_counter() - t0
        self.phases.add("experts", took)
        self.policy.compute.observe(self.device.type, "decoded", t, took)
        return y

    def _host_compute(self, key: ExpertKey, x: torch.Tensor, spec: MoESpec, staged: Any) -> torch.Tensor:
        """HOST: compute from the tier-2 weights (CPU: the stored bytes, decoded transiently;
        CUDA: the pinned compact bytes decoded on the CPU, moving only the activations)."""
        value = self.moves.host_value(key) if self.cuda or staged is None else staged
        t0 = time.perf_counter()  # after any disk read: q* prices that with the storage link
        if self.cuda:
            w = self.moves.decode(key, value)
            y = expert_forward(w, self._on_host(x), spec).to(self.device, non_blocking=True)
        else:
            with self.phases.time("experts"):
                y = expert_forward(self.moves.decode(key, value), x, spec)
        self.policy.compute.observe("cpu-host", self.codec[key], x.shape[0], time.perf_counter() - t0)
        return y

    def _on_host(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA: `x` on the CPU. A decode step runs every routed expert of a layer on the same
        hidden tensor, so it crosses once per layer (`run` clears the copy before each layer): a
        second HOST or SPLIT expert of the layer no longer waits, on a device sync, for the GPU
        work queued since the first (the tier-1 experts between them in expert order)."""
        held = self._hidden_host
        if held is not None and held[0] is x:
            return held[1]
        on_host = x.to("cpu")
        self._hidden_host = (x, on_host)
        return on_host

    def _split_compute(self, key: ExpertKey, x: torch.Tensor, spec: MoESpec, share: float) -> torch.Tensor:
        """SPLIT (CUDA): HOST, but the last `share` of the down projection's rows are copied (from
        the pinned tier-2 bytes where the CPU's form of them is a view, so asynchronously) and
        computed on the device (`routed.expert_forward_split`). The CPU's time is observed as a
        whole expert's: divided by the share of the expert it computed."""
        value = self.moves.host_value(key)
        t0 = time.perf_counter()
        w = self.moves.decode(key, value)
        rows = routed.split_rows(w.down.shape[0], share)
        y = routed.expert_forward_split(w, self._on_host(x), spec, self.device, rows)
        cpu_share = 1 - DOWN_SHARE * rows / w.down.shape[0]
        took = (time.perf_counter() - t0) / cpu_share
        self.policy.compute.observe("cpu-host", self.codec[key], x.shape[0], took)
        moved = sum(t[-rows:].nbytes for t in (w.down, w.down_scale, w.down_bias) if t is not None)
        with self._lock:
            self.moves.bytes_moved["host->fast"] += moved
        return y
