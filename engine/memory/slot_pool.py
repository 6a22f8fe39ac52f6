"""Tier 1's experts in one slot pool (`slots.ExpertSlots`), sized to tier 1's room.

`TierSlots` is what the tier mover (`moves.TierMover`) uses to keep tier 1 as slots: a promoted
expert is copied into a slot and tier 1 holds the slot's views; an evicted one frees its slot.
The pool takes the layout of the first expert (its template: float, or int8 / MXFP4 kept
compact, each with its scales and biases) and is allocated with as many slots as tier
1's byte capacity holds experts of that size (all experts when unbounded), and reallocated when
that room changes (`fit`: the KV cache grew or shrank, so tier 1 did) or when tier 1 has room
the pool lacks (`assign`). Each reallocation moves the buffer and bumps `epoch`: the mover then
re-points tier 1 at the new views (`views`), and a captured CUDA graph, which compares the
epoch, is captured again. Experts of another layout (another shape or form, a mixed expert)
stay outside the pool: `assign` returns None for them.
"""

from __future__ import annotations

import logging

import torch

from ..model.experts import ExpertKey, ExpertWeights
from .slots import ExpertSlots, slot_compatible

logger = logging.getLogger(__name__)


class TierSlots:
    """The slot pool of tier 1 (None until the first expert arrives).

    Args:
        num_layers / num_experts: the table's shape (max layer + 1, max expert + 1).
        total_experts: how many experts the file holds (the pool never needs more slots).
        device: where the pool lives (tier 1's device).
    """

    def __init__(self, num_layers: int, num_experts: int, total_experts: int, device: torch.device) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.total_experts, self.device = total_experts, device
        self.pool: ExpertSlots | None = None
        self.unit = 1  # tier 1's bytes for one expert of the pool's layout (what it counts)
        self.epoch = 0  # bumped whenever the pool's buffer moves

    def _slots_for(self, capacity_bytes: int | None) -> int:
        """As many slots as tier 1 counts experts in `capacity_bytes` (a slot row's alignment
        padding is not counted, so the pool never turns away an expert tier 1 took)."""
        if capacity_bytes is None:
            return self.total_experts
        return max(1, min(self.total_experts, capacity_bytes // self.unit))

    def assign(
        self, key: ExpertKey, weights: ExpertWeights, capacity_bytes: int | None, nbytes: int
    ) -> ExpertWeights | None:
        """Copy `weights` (`nbytes` as tier 1 counts them) into a slot, allocating or growing the
        pool to what `capacity_bytes` holds; its views, or None when the expert does not fit the
        pool's layout."""
        if not self.accepts(weights):
            return None
        if self.pool is None:
            self.unit = max(1, nbytes)
            slots = self._slots_for(capacity_bytes)
            self.pool = ExpertSlots(weights, slots, self.num_layers, self.num_experts, self.device)
            self.epoch += 1
            logger.debug("tier 1 slot pool: %d slots of %d bytes", slots, self.pool.row_bytes)
        assert self.pool is not None
        if self.pool.full:
            wanted = self._slots_for(capacity_bytes)
            if wanted <= self.pool.capacity:
                return None  # tier 1 counts the bytes: it evicted first, so this is another layout's room
            self._reallocate(wanted)
        assert self.pool is not None
        return self.pool.assign(key, weights)

    def accepts(self, weights: ExpertWeights) -> bool:
        """Whether `weights` can take a slot: an expert whose projections share one form, of the
        pool's layout once it has one."""
        return slot_compatible(weights) if self.pool is None else self.pool.holds_layout_of(weights)

    def release(self, key: ExpertKey) -> None:
        if self.pool is not None:
            self.pool.release(key)

    def fit(self, capacity_bytes: int | None) -> None:
        """Resize the pool to what tier 1's new `capacity_bytes` holds (tier 1 evicted first)."""
        if self.pool is None:
            return
        wanted = max(self._slots_for(capacity_bytes), len(self.pool))
        if wanted != self.pool.capacity:
            self._reallocate(wanted)

    def views(self) -> dict[ExpertKey, ExpertWeights]:
        """Every held expert's weights as views of the current buffer (after a reallocation,
        what tier 1 must hold instead of the old views)."""
        return self.pool.views() if self.pool is not None else {}

    def _reallocate(self, capacity: int) -> None:
        assert self.pool is not None
        logger.debug("tier 1 slot pool: %d -> %d slots", self.pool.capacity, capacity)
        self.pool = self.pool.resized(capacity)
        self.epoch += 1
