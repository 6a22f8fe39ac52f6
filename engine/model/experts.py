"""Experts as independent, addressable units, and the store interface the MoE block calls.

Every expert owns one contiguous storage with its projections as views into it, in one
canonical layout whatever the checkpoint's: `gate_up [2I, H]` (gate rows first, then up rows),
`down [H, I]`, optional biases `gate_up_bias [2I]`, `down_bias [H]`. Moving an expert between
memory tiers is therefore one copy, and FTW stores exactly these tensors.

A projection may instead be held in int8 (`int8.py`, FTW's ``int8`` codec): then `gate_up` / `down`
are int8 and `gate_up_scale [2I]` / `down_scale [H]` hold its fp32 per-row scales; such experts are
packed with `ExpertWeights.packed_mixed` and `routed.expert_forward` computes them with `int8_linear`
(fused int8 GEMV for decode, dequantize per block for prefill) without ever holding a float copy.
Or in MXFP4 (`mxfp4.py`, ``expert_quant="compact"``): `gate_up [2I, H/2]` uint8 blocks with
`gate_up_scale [2I, H/32]` uint8 E8M0 scales (likewise `down`), computed by `mxfp4_linear`.

Letters: T tokens, H hidden, I expert intermediate size, A active experts per token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..kernels.int8 import quantize
from ..spec import MoESpec
from . import routed
from .grouped_experts import ExpertStack, stack_capturable, stack_codec
from .routed import dispatch_experts as dispatch_experts  # re-exported: importers use these names
from .routed import expert_forward as expert_forward
from .routed import run_experts as run_experts

ExpertKey = tuple[int, int]  # (layer, expert)
PROJECTIONS = ("gate_up", "down", "gate_up_bias", "down_bias")
SCALES = ("gate_up_scale", "down_scale")  # per-row fp32 scales of int8 projections
_ALIGN = 64  # byte alignment of each tensor inside a mixed-dtype storage


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's tensors (views into `storage` when packed)."""

    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]
    gate_up_bias: torch.Tensor | None = None  # [2I]
    down_bias: torch.Tensor | None = None  # [H]
    storage: torch.Tensor | None = None  # flat buffer all of the above live in
    gate_up_scale: torch.Tensor | None = None  # [2I] fp32 iff gate_up is int8; [2I, H/32] uint8 iff MXFP4
    down_scale: torch.Tensor | None = None  # [H] fp32 iff down is int8; [H, I/32] uint8 iff MXFP4

    @classmethod
    def packed(
        cls, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> ExpertWeights:
        """Copy `tensors` (names from PROJECTIONS) into one contiguous buffer of `dtype` on `device`."""
        present = [name for name in PROJECTIONS if tensors.get(name) is not None]
        total = sum(tensors[name].numel() for name in present)
        storage = torch.empty(total, dtype=dtype, device=device)
        views: dict[str, torch.Tensor] = {}
        offset = 0
        for name in present:
            src = tensors[name]
            view = storage[offset : offset + src.numel()].view(src.shape)
            view.copy_(src)
            views[name] = view
            offset += src.numel()
        return cls(storage=storage, **views)

    @classmethod
    def packed_mixed(
        cls, tensors: Mapping[str, torch.Tensor], device: torch.device | str = "cpu"
    ) -> ExpertWeights:
        """Copy `tensors` (names from PROJECTIONS and SCALES), each keeping its own dtype, into one
        byte storage on `device` (each view 64-byte aligned): int8 projections with their scales."""
        present = [name for name in (*PROJECTIONS, *SCALES) if tensors.get(name) is not None]
        offsets, total = {}, 0
        for name in present:
            offsets[name] = total
            t = tensors[name]
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        storage = torch.empty(total, dtype=torch.uint8, device=device)
        views = _byte_views(storage, {n: tensors[n] for n in present}, offsets)
        for name in present:
            views[name].copy_(tensors[name])
        return cls(storage=storage, **views)

    @classmethod
    def quantized(
        cls, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> ExpertWeights:
        """Float projections -> int8 + per-row scales (FTW int8 codec); biases cast to `dtype`."""
        out: dict[str, torch.Tensor] = {}
        for name in ("gate_up", "down"):
            out[name], out[f"{name}_scale"] = quantize(tensors[name])
        for name in ("gate_up_bias", "down_bias"):
            if tensors.get(name) is not None:
                out[name] = tensors[name].to(dtype)
        return cls.packed_mixed(out, device)

    def to_device(self, device: torch.device | str) -> ExpertWeights:
        """A copy on `device` with one copy of the storage; the projections stay views into it.
        (An expert that is a view into a stack is copied tensor by tensor.)"""
        if self.storage is None:
            return ExpertWeights(**{n: t.to(device) for n, t in self.tensors().items()})
        storage = self.storage.to(device)
        base = self.storage.data_ptr()
        named = self.tensors()
        offsets = {n: t.data_ptr() - base for n, t in named.items()}
        if self.storage.dtype == torch.uint8:
            return ExpertWeights(storage=storage, **_byte_views(storage, named, offsets))
        size = self.storage.element_size()
        views = {
            n: storage[offsets[n] // size : offsets[n] // size + t.numel()].view(t.shape)
            for n, t in named.items()
        }
        return ExpertWeights(storage=storage, **views)

    @property
    def is_quantized(self) -> bool:
        """True when any projection is held compact (int8 or MXFP4)."""
        return self.gate_up_scale is not None or self.down_scale is not None

    @property
    def nbytes(self) -> int:
        if self.storage is not None:
            return self.storage.numel() * self.storage.element_size()
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The projections by name (biases and int8 scales only when present)."""
        out = {"gate_up": self.gate_up, "down": self.down}
        for name in ("gate_up_bias", "down_bias", *SCALES):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def _byte_views(
    storage: torch.Tensor, like: Mapping[str, torch.Tensor], offsets: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """Views of uint8 `storage` at byte `offsets` with the dtypes and shapes of `like`."""
    views = {}
    for name, t in like.items():
        nbytes = t.numel() * t.element_size()
        views[name] = storage[offsets[name] : offsets[name] + nbytes].view(t.dtype).view(t.shape)
    return views


class ExpertStore(ABC):
    """Where the MoE block gets its experts: resident stacks, an FTW file read on first use, the
    tiered memory, or a wrapper of one of those (routing counters, recorders).

    `get` and `run` are what every store does; the other capabilities are declared here with a
    default, so callers (the engine, anchors, CUDA graphs, the fingerprint) never probe for them:

    - `keys()`: every expert the store holds or can load (default: none listed);
    - `loaded_keys()` / `nbytes`: the experts in memory now and their bytes (default: `keys()`,
      unknown bytes);
    - `snapshot_state()` / `restore_state(state)`: the expert-cache state an anchor records and
      re-warms on rollback ({tier: [(layer, expert), ...]}; default: every key as "resident",
      restoring nothing);
    - `stats()`: JSON-able counters (default: experts and bytes in memory);
    - `graph_safe`: whether a decode step runs on the device alone, the condition for capturing
      it as a CUDA graph (default: False);
    - the static step (`cuda_graph.StaticDecode`): `static_step()` is the context its forward
      runs in, `finish_static_step()` says after it whether it is right (False: recompute it
      eagerly), `graph_wanted` whether a replay is worth trying now, and `graph_epoch` changes
      when the device buffers a captured graph reads were reallocated (defaults: a store whose
      static step is always right, nothing to record, never reallocated);
    - `weights_file()`: the FTW file experts are read from and its open descriptor, so the model
      fingerprint hashes the file actually read (default: None);
    - `close()`: stop threads and close files (default: nothing to release).
    """

    graph_safe: bool = False
    graph_epoch: int = 0
    graph_wanted: bool = True

    def static_step(self) -> AbstractContextManager[None]:
        """The context a static decode step's forward runs in."""
        return nullcontext()

    def finish_static_step(self) -> bool:
        """After a static decode step: whether its result is right (False: recompute eagerly)."""
        return True

    @abstractmethod
    def get(self, layer: int, expert: int) -> ExpertWeights: ...

    @abstractmethod
    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> torch.Tensor:
        """hidden [T, H], expert_ids [T, A] (int64), weights [T, A] -> [T, H]: the weighted sum of
        each token's selected experts; a store may decide per expert where and how it computes."""

    def keys(self) -> list[ExpertKey]:
        return []

    def loaded_keys(self) -> list[ExpertKey]:
        return self.keys()

    @property
    def nbytes(self) -> int | None:
        return None

    def snapshot_state(self) -> dict[str, list[ExpertKey]]:
        keys = self.keys()
        return {"resident": keys} if keys else {}

    def restore_state(self, state: Mapping[str, Sequence[ExpertKey]]) -> None:  # noqa: B027
        """Re-warm the store from a `snapshot_state` (warmth only: never changes results)."""

    def stats(self) -> dict[str, Any]:
        return {"experts_in_ram": len(self.loaded_keys()), "expert_bytes_in_ram": self.nbytes}

    def weights_file(self) -> tuple[Path, int] | None:
        return None

    def close(self) -> None:  # noqa: B027 (optional: most stores hold no threads or files)
        """Release threads and files (idempotent)."""


class DelegatingStore(ExpertStore):
    """An `ExpertStore` wrapping another one (`inner`) and delegating every capability to it but
    `close` (the wrapper does not own the inner store): the base of counters and recorders
    (`Engine.use_expert_provider`), which override what they observe."""

    def __init__(self, inner: ExpertStore) -> None:
        self.inner = inner

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        return self.inner.graph_safe

    @property
    def graph_epoch(self) -> int:  # type: ignore[override]
        return self.inner.graph_epoch

    @property
    def graph_wanted(self) -> bool:  # type: ignore[override]
        return self.inner.graph_wanted

    def static_step(self) -> AbstractContextManager[None]:
        return self.inner.static_step()

    def finish_static_step(self) -> bool:
        return self.inner.finish_static_step()

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.inner.get(layer, expert)

    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> torch.Tensor:
        return self.inner.run(layer, hidden, expert_ids, weights, spec)

    def keys(self) -> list[ExpertKey]:
        return self.inner.keys()

    def loaded_keys(self) -> list[ExpertKey]:
        return self.inner.loaded_keys()

    @property
    def nbytes(self) -> int | None:
        return self.inner.nbytes

    def snapshot_state(self) -> dict[str, list[ExpertKey]]:
        return self.inner.snapshot_state()

    def restore_state(self, state: Mapping[str, Sequence[ExpertKey]]) -> None:
        self.inner.restore_state(state)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def weights_file(self) -> tuple[Path, int] | None:
        return self.inner.weights_file()


class InMemoryExpertProvider(ExpertStore):
    """All experts resident (RAM or device memory).

    Each layer whose experts share one layout (float, int8 or MXFP4 for both projections; one
    shape, dtype and device) is stacked into an `ExpertStack` (slot = expert id), computed by
    grouped GEMMs (GEMVs for int8 / MXFP4 on a GPU) or the top-2 pair (`routed`); its
    `ExpertWeights` become views into the stack (the per-expert storages are released as each
    layer is stacked, so `experts` is updated in place and peak memory grows by one layer).
    Other layers (mixed experts) dispatch expert by expert (`routed.run_routed` chooses).
    """

    def __init__(self, experts: dict[ExpertKey, ExpertWeights]) -> None:
        self._experts = experts
        self._stacks: dict[int, ExpertStack] = {}
        for layer in sorted({k[0] for k in experts}):
            keys = sorted(k for k in experts if k[0] == layer)
            if _stackable([experts[k] for k in keys]) and [k[1] for k in keys] == list(range(len(keys))):
                stack = ExpertStack.stack([experts[k].tensors() for k in keys])
                self._stacks[layer] = stack
                for k in keys:
                    experts[k] = ExpertWeights(**stack.tensors(k[1]))

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self._experts[(layer, expert)]

    def keys(self) -> list[ExpertKey]:
        return sorted(self._experts)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._experts.values())

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step runs on the device alone (every MoE layer stacked and computed by
        grouped GEMMs): the condition for capturing it as a CUDA graph (`cuda_graph`)."""
        layers = {k[0] for k in self._experts}
        stacks = [self._stacks.get(layer) for layer in layers]
        return bool(layers) and all(
            stack is not None
            and routed.use_grouped(stack, 1)
            and stack_capturable(stack.codec, stack.gate_up.device, stack.gate_up.dtype)
            for stack in stacks
        )

    def stack(self, layer: int) -> ExpertStack | None:
        """The layer's stacked experts (slot = expert id), if it was stacked."""
        return self._stacks.get(layer)

    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> torch.Tensor:
        experts = self._experts
        return routed.run_routed(
            hidden,
            expert_ids,
            weights,
            spec,
            stack=self._stacks.get(layer),
            get=lambda e: experts[(layer, e)],
        )


def _stackable(experts: list[ExpertWeights]) -> bool:
    """Whether experts can share one `ExpertStack`: one stack codec (float, int8 or MXFP4 for
    both projections), same tensors, shapes, dtypes, device."""
    first = experts[0].tensors()
    if stack_codec(first) is None:
        return False
    sig = {n: (t.shape, t.dtype, t.device) for n, t in first.items()}
    return all({n: (t.shape, t.dtype, t.device) for n, t in w.tensors().items()} == sig for w in experts)
