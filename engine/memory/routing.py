"""Decayed routing frequency per expert: how often each expert has been routed to lately.

Every use of it ranks experts by the same measure: the pinned hot set of tier 1 (the hottest),
what leaves tier 2 and so RAM (the coldest), q*'s value of keeping an expert in tier 1, and the
prefetcher's priors when pre-gating predicts fewer experts than it may load.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

from ..model.experts import ExpertKey

ROUTING_DECAY = 0.99
"""The engine's per-step decay: a horizon of ~100 steps. Residency of an expert in a cache of a
quarter to a half of them lasts hundreds of steps, so its value is its use rate over such a
horizon; at 0.9 (~10 steps) q* streamed experts on a short burst and evicted steadily used ones.
Replayed on the calibrated synthetic traces (`freetoken simulate`, MXFP4, RTX 4090): Mixtral-8x7B
24.0 -> 24.7 tok/s at 50% of the expert bytes and 18.3 -> 18.5 at 25%, Qwen3-30B-A3B 133.8 ->
135.4 and 104.1 -> 106.1; on an RTX 5090 Mixtral 33.6 -> 34.9 and 24.6 -> 25.3."""


class RoutingFrequency:
    """Per MoE layer, expert -> decayed count: each step of a layer multiplies its counts by
    `decay`, then adds 1 for every expert routed to (a prefill step counts an expert once).

    Kept without touching the experts a step does not route to: `by_layer` holds each count
    divided by the layer's decay so far (a step adds decay^-steps to its experts' entries) and
    `of` multiplies it back. A step costs its routed experts, not all of the layer's (48 x 128
    multiplications a Qwen3-30B token before, ~0.25 ms); the order within a layer, which is
    what the prefetch priors read of `by_layer`, is the counts' order. Before decay^-steps
    overflows, a layer's entries are rescaled to their counts.
    """

    _RESCALE_ABOVE = 1e150

    def __init__(self, layers: Iterable[int], decay: float = ROUTING_DECAY) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.by_layer: dict[int, dict[int, float]] = {lay: {} for lay in layers}
        self._scale = dict.fromkeys(self.by_layer, 1.0)  # decay^steps since the last rescale
        self._epoch = dict.fromkeys(self.by_layer, 0)  # rescales so far
        self.steps = dict.fromkeys(self.by_layer, 0)  # steps noted per layer

    def note(self, layer: int, used: Iterable[int]) -> None:
        """`layer` ran one step routed to `used` (distinct expert ids)."""
        counts = self.by_layer[layer]
        self.steps[layer] += 1
        scale = self._scale[layer] * self.decay
        if 1.0 / scale > self._RESCALE_ABOVE:
            for e in counts:
                counts[e] *= scale / self.decay  # the counts as of the previous step
            scale = self.decay
            self._epoch[layer] += 1
        self._scale[layer] = scale
        add = 1.0 / scale
        # counts[e] += add for each e, as C-level calls (no bytecode per expert: a decode step of
        # Qwen3-30B-A3B notes 48 layers x 8 experts); `add + c` is `c + add` bit for bit.
        used = used if isinstance(used, (list, tuple)) else list(used)  # read twice below
        counts.update(zip(used, map(add.__add__, map(counts.get, used, repeat(0.0))), strict=True))

    def of(self, key: ExpertKey) -> float:
        """The decayed count of `key` (0 if never routed to)."""
        return self.by_layer[key[0]].get(key[1], 0.0) * self._scale[key[0]]

    __call__ = of  # a tier's rank (`ranked.LayeredRank`)

    def rate(self, key: ExpertKey) -> float:
        """`key`'s uses per step: its count over the decayed number of steps noted, sum of d^i
        for i < n = (1 - d^n) / (1 - d). Not `of(key) x (1 - d)`, the steady state's, which a
        layer noted n steps reads low by 1 - d^n: 0.15 of the rate after 16 steps at 0.99."""
        n = self.steps[key[0]]
        if not n:
            return 0.0
        d = self.decay
        steps = n if d == 1.0 else (1.0 - d**n) / (1.0 - d)
        return self.of(key) / steps

    def raw(self, key: ExpertKey) -> float:
        """`key`'s undecayed entry: `of(key)` is it times `scale(layer)`; it only grows until the
        layer's counts are rescaled (`epoch`)."""
        return self.by_layer[key[0]].get(key[1], 0.0)

    def scale(self, layer: int) -> float:
        return self._scale[layer]

    def epoch(self, layer: int) -> int:
        """How many times `layer`'s entries were rescaled (each changes every `raw` of the layer)."""
        return self._epoch[layer]

    def hottest(self, among: Iterable[ExpertKey] | None = None) -> list[ExpertKey]:
        """Every expert routed to so far (of `among`, when given), most frequent first (ties:
        higher layer, expert first)."""
        scale, by_layer = self._scale, self.by_layer
        if among is None:
            among = [(lay, e) for lay, counts in by_layer.items() for e in counts]
        ranked = sorted(
            ((by_layer[k[0]][k[1]] * scale[k[0]], k) for k in among if k[1] in by_layer[k[0]]),
            reverse=True,
        )
        return [k for _, k in ranked]
