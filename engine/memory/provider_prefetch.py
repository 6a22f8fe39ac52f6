"""PrefetchAhead: a provider's pre-gating prefetch of the experts the next MoE layers will use.

Prefetch (`Prefetcher`): pre-gating predicts the next `prefetch_depth` layers' experts while a
layer computes; loader threads read them into tier 2 (CPU) or, on CUDA, also copy them into staging
room on the device when the link can land them in time (`ExpertPlanner.should_stage`), so disk
reads and copies overlap compute; q* then keeps a staged expert (STREAM) or computes it once from
its staged copy (STAGED, evicting nothing from the LRU; the copy may stay a token or two in tier
1's recent segment, sized by `RecentCopies`). The experts predicted for the
coming layers are "needed soon": the tiers evict them last, so a prefetch never pushes out what
the next layers are about to use.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..model.experts import ExpertKey
from .planner import ExpertPlanner
from .prefetch import Prefetcher
from .pregate import AheadRouters
from .routing import RoutingFrequency
from .stats import PhaseTimer


class PrefetchAhead:
    """The prefetch part of `TieredExpertProvider` (a mixin: its attributes are the provider's)."""

    fast: Any
    host: Any
    moves: Any
    planner: ExpertPlanner
    prefetcher: Prefetcher | None
    ahead_routers: AheadRouters | None
    routers: dict[int, torch.nn.Module]
    routing: RoutingFrequency
    phases: PhaseTimer
    top_k: dict[int, int]
    cuda: bool
    spare_bytes: int
    _staging_slot: int
    _ahead: dict[int, list[int]]

    def _prefetch_load(self, key: ExpertKey) -> Any:
        wanted = self.prefetcher.wanted if self.prefetcher is not None else None
        # CUDA: a copy is staged only when the link can land it in time (`should_stage`).
        stage = bool(self.spare_bytes) and self.planner.should_stage(key)
        still_wanted = (lambda: wanted(key)) if wanted else None
        return self.moves.prefetch_load(key, stage=stage, still_wanted=still_wanted)

    def _in_ram(self, key: ExpertKey) -> bool:
        """Whether a prefetch of `key` has nothing to do (CUDA: staged copies come from tier 2)."""
        return key in self.fast or (not self.cuda and key in self.host)

    def _prefetch_next(self, layer: int, hidden: torch.Tensor) -> None:
        """Pre-gate and issue loads for the next `prefetch_depth` MoE layers, nearest first."""
        if self.prefetcher is None:
            return
        # Staged decoded experts must fit the spare buffer (`_staging_slot`: the largest expert's
        # tier-1 bytes, taken once: a max over every expert here cost Qwen3-30B ~2 ms a token);
        # tier-2-only prefetch is cheap.
        slot = self._staging_slot
        self.prefetcher.max_inflight = max(1, self.spare_bytes // slot) if self.spare_bytes else 8
        ahead = self.ahead_routers.choose(layer, hidden) if self.ahead_routers is not None else None
        predicting = 0.0  # the "predict" phase, timed without a context manager per layer ahead
        nexts = self._ahead[layer]
        for d, nxt in enumerate(nexts):
            t0 = time.perf_counter()
            pred = self.prefetcher.predict(
                nxt,
                hidden,
                self.routers.get(nxt),
                self.top_k[nxt],
                self.routing.by_layer[nxt],
                score=d == 0,
                pregated=ahead[d] if ahead is not None else None,
            )
            predicting += time.perf_counter() - t0
            self.planner.expect(nxt, pred)
            self.prefetcher.issue(nxt, pred, skip=self._in_ram)
        if nexts:
            self.phases.add("predict", predicting, len(nexts))
