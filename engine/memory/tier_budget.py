"""FastBudget: tier 1's room in fast memory, shared with the KV cache and the prefetch staging room.

Fast memory is shared with the KV cache: the engine gives `on_kv_resize` to its BlockPool as
`on_resize`; KV growth shrinks tier 1 (prefetch staging first, then coldest experts,
pinned last; zero-copy blocks are demoted to tier 2), freed KV regrows it. MemoryBudgetError when
even one layer's top_k experts cannot fit (at construction, or when KV would take that room; the
KV block is then refused and the session keeps its state).
On CUDA with q*, the staging room follows what the link can land while a layer computes
(`_refit_staging`, every `hot_every` steps).
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import MemoryBudgetError
from .budget import MemoryBudget, format_size
from .planner import ExpertPlanner

logger = logging.getLogger(f"{__package__}.provider")  # its records under the provider's name


class FastBudget:
    """The budget part of `TieredExpertProvider` (a mixin: its attributes are the provider's)."""

    budget: MemoryBudget
    kv_bytes: int
    spare_bytes: int
    min_working_set: int
    fast: Any
    moves: Any
    planner: ExpertPlanner
    cuda: bool
    exclusive: bool
    prefetch_depth: int
    top_k: dict[int, int]
    _prefetch_wanted: bool
    _staging_slot: int
    _lock: Any  # the mover's lock (`TierMover.lock`)

    def _apply_fast_budget(self) -> None:
        total = self.budget.fast_bytes
        if total is None:
            self._set_spare(self._target_spare())
            self.fast.resize(None)
            return
        avail = total - self.kv_bytes
        if avail < self.min_working_set:
            need = self.kv_bytes + self.min_working_set
            raise MemoryBudgetError(
                f"fast memory budget of {total} bytes cannot hold the KV cache ({self.kv_bytes} "
                f"bytes) plus the minimum expert working set ({self.min_working_set} bytes: one "
                f"layer's top-k experts); raise MemoryBudget.fast_bytes to at least {need} bytes "
                f"({format_size(need)}) or shorten the context",
                option="fast_bytes",
                minimum_bytes=need,
            )
        # Prefetch staging (the spare half of the double buffer) goes first under pressure. On a
        # CPU-only machine prefetch reads ahead into tier 2 only: HOST computes straight from the
        # stored bytes, so decoded staging copies would only take room from tier 1.
        self._set_spare(self._target_spare())
        evicted = self.fast.resize(avail - self.spare_bytes)  # `moves` demotes or spills them
        if self.planner.recent is not None:
            evicted += self.planner.recent.fit()
        self.moves.fit_slots()
        if evicted:
            logger.debug("fast tier shrank to %d bytes: evicted %s", avail - self.spare_bytes, evicted)

    def _staging_bytes(self) -> int:
        """CUDA prefetch staging: room for the copies that wait at once (`ExpertPlanner.staging_room`:
        every expert predicted for the next `prefetch_depth` layers until a layer time is measured,
        then what the link can land in that time), each the size of the largest expert."""
        if not (self._prefetch_wanted and self.cuda):
            return 0
        if not self.exclusive:  # the "stream" baseline (per-layer LRU) as it was measured
            return self.prefetch_depth * self.min_working_set
        return self.planner.staging_room(self.prefetch_depth, max(self.top_k.values())) * self._staging_slot

    def _target_spare(self) -> int:
        """The staging room the fast budget gives now: none if tier 1 would be left less than the
        minimum working set."""
        wanted = self._staging_bytes()
        total = self.budget.fast_bytes
        if total is None or total - self.kv_bytes - wanted >= self.min_working_set:
            return wanted
        return 0

    def _set_spare(self, spare: int) -> None:
        """The staging room is `spare` bytes: as many staged copies may wait at once."""
        self.spare_bytes = spare
        self.planner.room = spare // self._staging_slot if spare else None

    def _refit_staging(self) -> None:
        """CUDA, every `hot_every` steps: the staging room follows what the link can fill; what it
        no longer needs goes back to tier 1 (and what it needs again comes from tier 1)."""
        room = self.planner.staging_room(self.prefetch_depth, max(self.top_k.values()))
        if not self.planner.room_settled(room) and self._target_spare() != self.spare_bytes:
            with self._lock:
                self._apply_fast_budget()

    def on_kv_resize(self, kv_bytes: int) -> None:
        """BlockPool.on_resize: KV now needs `kv_bytes` of fast memory; resize the expert tier."""
        old = self.kv_bytes
        self.kv_bytes = kv_bytes
        try:
            with self._lock:
                self._apply_fast_budget()
        except MemoryBudgetError:
            self.kv_bytes = old
            raise
