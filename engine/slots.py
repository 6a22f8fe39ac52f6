"""Tier 1 as preallocated expert slots with a device-side table expert -> slot.

`ExpertSlots` holds `capacity` packed experts of one shape in one device buffer `[S, P]` (each
row laid out as `ExpertWeights.packed` lays out one expert: gate_up, down, biases), so bringing
an expert in is one row copy. Its `stack` views the buffer as an `ExpertStack` (`gate_up
[S, 2I, H]`, ... with a row stride of P) and `table [layers, experts]` (int64, -1 when absent)
maps routed experts to slots on the device. A layer's MoE is then one grouped GEMM per
projection over the slots (`grouped_experts.run_grouped`) with no host sync: `run` returns the
output and a device flag saying whether any routed expert was absent, which the caller reads
once per step (with the sampled token, a sync it makes anyway) and answers by recomputing the
step eagerly through q*. Device-agnostic (tests run it on CPU).

Letters: S slots, P elements of one packed expert, T tokens, A experts per token.
"""

from __future__ import annotations

import torch

from .experts import PROJECTIONS, ExpertKey, ExpertWeights
from .grouped_experts import ExpertStack, run_grouped
from .spec import MoESpec


class SlotsFullError(RuntimeError):
    """Every slot is taken; release one first."""


class ExpertSlots:
    """`capacity` slots for experts laid out like `template` (a packed float expert)."""

    def __init__(
        self,
        template: ExpertWeights,
        capacity: int,
        num_layers: int,
        num_experts: int,
        device: torch.device | str,
    ) -> None:
        if template.storage is None or template.is_quantized or not template.storage.is_floating_point():
            raise ValueError("ExpertSlots takes packed float experts (ExpertWeights.packed)")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        base = template.storage
        self.dtype, self.device = base.dtype, torch.device(device)
        self.row = base.numel()
        self._layout = {  # name -> (element offset in a row, shape)
            name: (
                t.data_ptr() // base.element_size() - base.data_ptr() // base.element_size(),
                tuple(t.shape),
            )
            for name, t in template.tensors().items()
        }
        self.buffer = torch.zeros(capacity, self.row, dtype=self.dtype, device=self.device)
        self.table = torch.full((num_layers, num_experts), -1, dtype=torch.long, device=self.device)
        self._slot_of: dict[ExpertKey, int] = {}
        self._free = list(reversed(range(capacity)))
        self.stack = ExpertStack(**{n: self._strided(n) for n in PROJECTIONS if n in self._layout})

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0]

    def _strided(self, name: str) -> torch.Tensor:
        """All slots' `name` tensor as one strided view [S, *shape] of the buffer."""
        offset, shape = self._layout[name]
        strides = [self.row]
        step = 1
        for dim in reversed(shape):
            strides.insert(1, step)
            step *= dim
        return self.buffer.as_strided((self.capacity, *shape), tuple(strides), offset)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def slot_of(self, key: ExpertKey) -> int | None:
        return self._slot_of.get(key)

    def assign(self, key: ExpertKey, weights: ExpertWeights) -> ExpertWeights:
        """Copy a packed expert (same layout as the template) into a free slot and enter it in
        the table; returns its weights as views of the slot. SlotsFullError when none is free."""
        if key in self._slot_of:
            return self.weights(self._slot_of[key])
        src = weights.storage
        if src is None or src.numel() != self.row or src.dtype != self.dtype:
            raise ValueError(f"expert {key} is not packed like this pool's template")
        if not self._free:
            raise SlotsFullError(f"all {self.capacity} expert slots are taken")
        slot = self._free.pop()
        self.buffer[slot].copy_(src, non_blocking=True)
        self._slot_of[key] = slot
        self.table[key[0], key[1]] = slot
        return self.weights(slot)

    def release(self, key: ExpertKey) -> None:
        """Free `key`'s slot (absent keys are ignored); the table marks it absent."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return
        self.table[key[0], key[1]] = -1
        self._free.append(slot)

    def weights(self, slot: int) -> ExpertWeights:
        """One slot's tensors as views of the buffer (what tier 1 holds for the expert)."""
        row = self.buffer[slot]
        views = {n: row[o : o + _numel(s)].view(s) for n, (o, s) in self._layout.items()}
        return ExpertWeights(**views)

    def lookup(self, layer: int, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """expert_ids [T, A] -> (slots [T, A] with absent experts at slot 0, a 0-d bool device
        tensor: any absent). No host sync."""
        slots = self.table[layer].index_select(0, expert_ids.reshape(-1)).view(expert_ids.shape)
        return slots.clamp(min=0), (slots < 0).any()

    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's routed experts as one grouped GEMM over the slots -> (out [T, H], miss).
        When `miss` is true the output is wrong (an absent expert ran as slot 0's): recompute."""
        slots, miss = self.lookup(layer, expert_ids)
        return run_grouped(self.stack, hidden, slots, weights, spec), miss


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
