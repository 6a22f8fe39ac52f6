"""The tiered store's side of a static (CUDA-graph) decode step.

In a static step (`cuda_graph.StaticDecode.forward`, captured once and replayed) nothing may
read the routing on the host, so each MoE layer runs as one grouped GEMM over tier 1's slot pool
(`slots.ExpertSlots.run`): an expert missing from tier 1 runs as slot 0's, and the pool's device
miss flag says so. `GraphSteps` records, while the static forward runs (`recording`), each
layer's routed ids and the OR of the miss flags; both are tensors the graph rewrites at every
replay. After the step, `finish` reads the flag (the step's one host sync, next to the one the
sampler makes anyway):

- no miss: the step is right. The routing is read back in one copy and noted as an eager step
  would note it (routing frequency, tier-1 recency, RESIDENT counts: `on_resident`);
- a miss: the step is wrong from the first missing layer on, so the caller recomputes it
  eagerly, where q* decides for the misses and promotes what it decides to keep (the K/V the
  replay wrote are written again at the same slots).

A replay that misses costs a wasted step, so `wanted` asks for replays only while most recent
decode steps ran with every routed expert in tier 1 (`hit_rate`, an EMA over static and eager
steps alike; eager steps keep it current while replays are not wanted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from ..spec import MoESpec
from .slot_pool import TierSlots

_EMA = 0.2  # weight of the newest step in `hit_rate`
_WANTED = 0.5  # replays are tried while at least this share of recent steps hit


class GraphSteps:
    """Records and checks static decode steps over `slots`; `on_resident(layer, used)` notes a
    layer whose routed experts (sorted ids) all ran from tier 1; `first_layer`: the first MoE
    layer (a step begins there)."""

    def __init__(
        self, slots: TierSlots, on_resident: Callable[[int, Sequence[int]], None], first_layer: int
    ) -> None:
        self.slots, self.on_resident, self.first_layer = slots, on_resident, first_layer
        self.recording_now = False
        self._layers: list[int] = []
        self._ids: list[torch.Tensor] = []
        self._miss: torch.Tensor | None = None
        self.hit_rate = 1.0
        self._step_hit: bool | None = None  # the eager step under way: every layer all in tier 1
        self.steps = self.reruns = 0

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The static forward runs inside: `run` serves its MoE layers and records them."""
        self._layers, self._ids, self._miss = [], [], None
        self.recording_now = True
        try:
            yield
        finally:
            self.recording_now = False

    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> torch.Tensor:
        """hidden [T, H], expert_ids [T, A], weights [T, A] -> [T, H] over the slot pool, with
        no host sync; a missing expert (or no pool yet) sets the step's miss flag."""
        pool = self.slots.pool
        if pool is None:
            out, miss = torch.zeros_like(hidden), torch.ones((), dtype=torch.bool, device=hidden.device)
        else:
            out, miss = pool.run(layer, hidden, expert_ids, weights, spec)
        self._layers.append(layer)
        self._ids.append(expert_ids)
        self._miss = miss if self._miss is None else self._miss | miss
        return out

    def finish(self) -> bool:
        """After a static step: True if it is right (its routing then noted), False if a routed
        expert was missing from tier 1 (recompute the step eagerly)."""
        if self._miss is None:  # no MoE layer ran
            return True
        self.steps += 1
        hit = not bool(self._miss.item())
        self._note_step(hit)
        if not hit:
            self.reruns += 1
            return False
        routed = torch.stack(self._ids).tolist()  # [L, T, A] in one copy
        for layer, per_token in zip(self._layers, routed, strict=True):
            self.on_resident(layer, sorted({e for row in per_token for e in row}))
        return True

    def note_eager_layer(self, layer: int, all_in_tier1: bool) -> None:
        """An eager decode step ran `layer`, its routed experts all in tier 1 or not."""
        if layer == self.first_layer:
            if self._step_hit is not None:
                self._note_step(self._step_hit)
            self._step_hit = all_in_tier1
        elif self._step_hit is not None:
            self._step_hit = self._step_hit and all_in_tier1

    def _note_step(self, hit: bool) -> None:
        self.hit_rate = (1 - _EMA) * self.hit_rate + _EMA * float(hit)

    @property
    def wanted(self) -> bool:
        """Whether a replay is likely to hit (most recent steps ran all in tier 1)."""
        return self.hit_rate >= _WANTED

    def stats(self) -> dict[str, float | int]:
        return {"static_steps": self.steps, "reruns": self.reruns, "hit_rate": round(self.hit_rate, 3)}
