"""StaticSteps: a provider's decode steps run as captured CUDA graphs (`graph_steps.GraphSteps`).

A decode step can be captured when tier 1 is a slot pool that can hold every expert of the file
and its grouped kernels are capturable on the device; a replay runs the step over the slot pool
with no host sync, and notes its routing as an eager step would.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from ..model.grouped_experts import stack_capturable
from .graph_steps import GraphSteps
from .planner import ExpertPlanner
from .policy import QStarPolicy


class StaticSteps:
    """The static-step part of `TieredExpertProvider` (a mixin: its attributes are the provider's)."""

    fast: Any
    moves: Any
    planner: ExpertPlanner
    policy: QStarPolicy
    graph_steps: GraphSteps | None
    cuda: bool
    device: torch.device
    dtype: torch.dtype
    _lock: Any  # the mover's lock (`TierMover.lock`)

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        """A decode step can run on the device alone: tier 1 is a slot pool that can hold every
        expert of the file (one layout: float, int8 or MXFP4) and its grouped kernels (GEMM or
        GEMVs) are capturable there."""
        codec = self.moves.tier1_codec
        if self.moves.slots is None or not self.cuda or codec is None:
            return False
        return stack_capturable(codec, self.device, self.dtype)

    @property
    def graph_epoch(self) -> int:  # type: ignore[override]
        """Changes when the slot pool's buffer moves (a captured graph must be captured again)."""
        return self.moves.slots.epoch if self.moves.slots is not None else 0

    @property
    def graph_wanted(self) -> bool:  # type: ignore[override]
        """Whether a replay is likely to hit: most recent decode steps ran all in tier 1."""
        return self.graph_steps is not None and self.graph_steps.wanted

    def static_step(self) -> AbstractContextManager[None]:
        return self.graph_steps.recording() if self.graph_steps is not None else nullcontext()

    def finish_static_step(self) -> bool:
        return self.graph_steps.finish() if self.graph_steps is not None else True

    def _note_resident(self, layer: int, used: Sequence[int]) -> None:
        """A static step ran `layer` with `used` all from tier 1: noted as an eager step notes it."""
        self.planner.note_routing(layer, used)
        with self._lock:
            self.fast.get_all([(layer, e) for e in used])
        self.policy.count_resident(len(used), 1)
