"""Decayed routing frequency per expert: how often each expert has been routed to lately.

Every use of it ranks experts by the same measure: the pinned hot set of tier 1 (the hottest),
what leaves tier 2 and so RAM (the coldest), q*'s value of keeping an expert in tier 1, and the
prefetcher's priors when pre-gating predicts fewer experts than it may load.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..experts import ExpertKey

ROUTING_DECAY = 0.99
"""The engine's per-step decay: a horizon of ~100 steps. Residency of an expert in a cache of a
quarter to a half of them lasts hundreds of steps, so its value is its use rate over such a
horizon; at 0.9 (~10 steps) q* streamed experts on a short burst and evicted steadily used ones.
Replayed on the calibrated synthetic traces (`freetoken simulate`, MXFP4, RTX 4090): Mixtral-8x7B
24.0 -> 24.7 tok/s at 50% of the expert bytes and 18.3 -> 18.5 at 25%, Qwen3-30B-A3B 133.8 ->
135.4 and 104.1 -> 106.1; on an RTX 5090 Mixtral 33.6 -> 34.9 and 24.6 -> 25.3."""


class RoutingFrequency:
    """Per MoE layer, expert -> decayed count: each step of a layer multiplies its counts by
    `decay`, then adds 1 for every expert routed to (a prefill step counts an expert once)."""

    def __init__(self, layers: Iterable[int], decay: float = ROUTING_DECAY) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.by_layer: dict[int, dict[int, float]] = {lay: {} for lay in layers}

    def note(self, layer: int, used: Iterable[int]) -> None:
        """`layer` ran one step routed to `used`."""
        counts = self.by_layer[layer]
        for e in counts:
            counts[e] *= self.decay
        for e in used:
            counts[e] = counts.get(e, 0.0) + 1.0

    def of(self, key: ExpertKey) -> float:
        """The decayed count of `key` (0 if never routed to)."""
        return self.by_layer[key[0]].get(key[1], 0.0)

    def hottest(self) -> list[ExpertKey]:
        """Every expert routed to so far, most frequent first (ties: higher layer, expert first)."""
        ranked = sorted(
            ((v, (lay, e)) for lay, counts in self.by_layer.items() for e, v in counts.items()), reverse=True
        )
        return [k for _, k in ranked]
