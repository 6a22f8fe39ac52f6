"""Tier 1 as preallocated expert slots with a device-side table expert -> slot.

`ExpertSlots` holds `capacity` experts of one layout in one device byte buffer `[S, P]`: each row
holds one expert's tensors (gate_up, down, biases and, for int8 or MXFP4 experts, their scales),
each at an aligned byte offset in its own dtype, so bringing an expert in is a copy into one row.
Its `stack` views the buffer as an `ExpertStack` (`gate_up [S, 2I, H]`, ... with a row stride of
P bytes) and `table [layers, experts]` (int64, -1 when absent) maps routed experts to slots on
the device. A layer's MoE is then one grouped GEMM per projection over the slots (float), or
the grouped GEMVs (int8, MXFP4: `grouped_experts.run_grouped`), with no host sync: `run`
returns the output and a device flag saying whether any routed expert was absent, which the
caller reads once per step (with the sampled token, a sync it makes anyway) and answers by
recomputing the step eagerly through q*. Device-agnostic (tests run it on CPU). The tiered
store's tier 1 keeps its experts here (`memory.moves.TierMover`, by default on CUDA); `resized`
reallocates the pool when tier 1's room changes (KV growth), which moves the buffer (a captured
graph is then captured again).

Letters: S slots, P bytes of one slot row (an expert, padded), T tokens, A experts per token.
"""

from __future__ import annotations

import torch

from ..model.experts import ExpertKey, ExpertWeights
from ..model.grouped_experts import ExpertStack, run_grouped, stack_codec
from ..spec import MoESpec

# Each tensor of a row, and each row, starts at a multiple of this many bytes: the grouped GEMM
# on a GPU wants 16-byte aligned strides and data pointers, and a typed view of the byte buffer
# needs its offset to be a multiple of its element size.
_ALIGN = 128


class SlotsFullError(RuntimeError):
    """Every slot is taken; release one first."""


class ExpertSlots:
    """`capacity` slots for experts laid out like `template` (any `ExpertWeights` whose two
    projections share one form: float, int8 or MXFP4; a slot row holds its tensors at aligned
    byte offsets)."""

    def __init__(
        self,
        template: ExpertWeights,
        capacity: int,
        num_layers: int,
        num_experts: int,
        device: torch.device | str,
    ) -> None:
        if not slot_compatible(template):
            raise ValueError(
                "ExpertSlots takes experts whose projections share one form (float, int8, MXFP4)"
            )
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.device = torch.device(device)
        # name -> (byte offset in a row, shape, dtype)
        self._layout: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        for name, t in template.tensors().items():
            self._layout[name] = (offset, tuple(t.shape), t.dtype)
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self.row = offset
        # Normal tensors (the buffer, the table, the stack's views, which `weights` indexes) even
        # when the pool is made during a forward (inference mode): it is written outside one too
        # (a rollback re-warms tier 1), which an inference tensor refuses.
        with torch.inference_mode(False):
            self.buffer = torch.zeros(capacity, self.row, dtype=torch.uint8, device=self.device)
            self.table = torch.full((num_layers, num_experts), -1, dtype=torch.long, device=self.device)
            self.stack = ExpertStack(**{n: self._strided(n) for n in self._layout})
        self._slot_of: dict[ExpertKey, int] = {}
        self._free = list(reversed(range(capacity)))

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot (one expert)."""
        return self.row

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def full(self) -> bool:
        return not self._free

    def holds_layout_of(self, weights: ExpertWeights) -> bool:
        """Whether `weights` can take a slot here (the same tensors, shapes and dtypes)."""
        named = weights.tensors()
        return {n: (tuple(t.shape), t.dtype) for n, t in named.items()} == {
            n: (shape, dtype) for n, (_, shape, dtype) in self._layout.items()
        }

    def resized(self, capacity: int) -> ExpertSlots:
        """A pool of `capacity` slots holding the same experts (copied, in slot order; at most
        `capacity` of them may be held). The old pool's buffer is freed once nothing refers to it."""
        if capacity < len(self):
            raise SlotsFullError(f"{len(self)} experts held, cannot shrink to {capacity} slots")
        layers, experts = self.table.shape
        out = ExpertSlots(self.weights(0), capacity, layers, experts, self.device)
        for key, slot in sorted(self._slot_of.items(), key=lambda item: item[1]):
            out.assign(key, self.weights(slot))
        return out

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0]

    def _strided(self, name: str) -> torch.Tensor:
        """All slots' `name` tensor as one strided view [S, *shape] of the buffer, in its dtype."""
        offset, shape, dtype = self._layout[name]
        size = dtype.itemsize
        strides = [self.row // size]
        step = 1
        for dim in reversed(shape):
            strides.insert(1, step)
            step *= dim
        return self.buffer.view(dtype).as_strided((self.capacity, *shape), tuple(strides), offset // size)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def slot_of(self, key: ExpertKey) -> int | None:
        return self._slot_of.get(key)

    def assign(self, key: ExpertKey, weights: ExpertWeights) -> ExpertWeights:
        """Copy an expert (laid out like this pool's template) into a free slot and enter it in
        the table; returns its weights as views of the slot. SlotsFullError when none is free;
        ValueError for an expert of another layout."""
        if key in self._slot_of:
            return self.weights(self._slot_of[key])
        if not self.holds_layout_of(weights):
            raise ValueError(f"expert {key} is not laid out like this pool's template")
        if not self._free:
            raise SlotsFullError(f"all {self.capacity} expert slots are taken")
        slot = self._free.pop()
        views = self.weights(slot).tensors()
        for name, t in weights.tensors().items():  # copies on the current stream, in order
            views[name].copy_(t, non_blocking=True)
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
        return ExpertWeights(**self.stack.tensors(slot))

    def views(self) -> dict[ExpertKey, ExpertWeights]:
        """Every held expert's weights as views of its slot."""
        return {key: self.weights(slot) for key, slot in self._slot_of.items()}

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


def slot_compatible(weights: ExpertWeights) -> bool:
    """Whether an expert can live in a slot pool: both projections in one form (float, or int8 /
    MXFP4 with their scales: a stack's codec); a mixed expert stays outside."""
    return stack_codec(weights.tensors()) is not None
