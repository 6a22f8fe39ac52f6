"""The decode step as a CUDA graph: a token with every routed expert resident is one replay.

`StaticDecode` holds static device buffers for one decode step (token, position, KV slot, the
sequence's block table and the attended ranges) and a forward that reads only them: rotary
tables computed on the device, attention through the Triton paged kernel (`paged_triton`, a
`layers.StaticAttention` in the step context), the MoE through the resident stacks' grouped
GEMMs. Nothing in it syncs with the host or changes shape with the length, so `CudaGraphDecode`
captures it once (after a warm-up on a side stream) and each token copies its inputs into the
buffers and replays. The graph is captured again when it cannot serve a step: the sequence
outgrew its block table (capacity doubles), the KV pool's storage was reallocated, or the expert
provider changed. `graph_unsupported` says why a model cannot be captured (then the decode
runner, `decode_runner.DecodeRunner`, decodes eagerly): the option `cuda_graphs` off, not on
CUDA, no Triton, int8 layers, or a
provider whose decode needs the host. The tiered store is capturable with tier 1 as a slot pool
(`memory.graph_steps`): its static step runs every MoE layer over the slots, and a step whose
device miss flag is set (a routed expert not in tier 1) is answered by an eager rerun, where q*
decides for the misses (`DecodeGraphs.run` returns None; the runner recomputes). The graph is
captured again when the store's `graph_epoch` changes (the slot pool moved).

Only `StaticDecode` runs on CPU (the tests drive it through Triton's interpreter); the capture
and replay have never run in this repository's CI (no GPU): tests/test_cuda_decode.py covers them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..model.layers import StaticAttention, StepContext, rope_cos_sin

if TYPE_CHECKING:
    from ..model.kv import BlockTable
    from ..spec import ModelSpec


logger = logging.getLogger(__name__)


class DecodeModel(Protocol):
    """What a captured decode step needs of the model (`transformer.MoETransformer` is one);
    declared here so this module never imports the transformer that drives it."""

    spec: ModelSpec
    layers: torch.nn.ModuleList
    embed_tokens: torch.nn.Embedding

    def modules(self) -> Iterator[torch.nn.Module]: ...
    def forward_layers(
        self, tokens: torch.Tensor, ctx: StepContext, *, last_only: bool = ...
    ) -> torch.Tensor: ...


def graph_unsupported(model: DecodeModel, device: torch.device, *, cuda_graphs: bool = True) -> str | None:
    """Why `model`'s decode step cannot be captured on `device` (None: it can); `cuda_graphs`:
    the option (`EngineOptions.cuda_graphs`), checked first."""
    from ..kernels.int8 import Int8Linear
    from ..model.moe import MoEBlock

    if not cuda_graphs:
        return "cuda_graphs=False"
    if device.type != "cuda":
        return "not on a CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return "int8 dense layers"
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoEBlock) and (mlp.provider is None or not mlp.provider.graph_safe):
            return f"the expert provider {type(mlp.provider).__name__} needs the host to decode"
    return None


class StaticDecode:
    """Static buffers of one decode step and the forward that reads only them."""

    def __init__(self, model: DecodeModel, table: BlockTable, max_blocks: int, device: torch.device) -> None:
        self.model, self.pool, self.max_blocks = model, table.pool, max_blocks
        self.table = table  # only its pool is used (writes), so any table of the pool will do
        self.tokens = torch.zeros(1, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.new_slots = torch.zeros(1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(max_blocks, dtype=torch.int32, device=device)
        windows = {layer.self_attn.spec.sliding_window for layer in model.layers}
        self.ranges = {w: torch.zeros(2, dtype=torch.int32, device=device) for w in windows}
        self.dtype = model.embed_tokens.weight.dtype
        self.storage_ptr = self._storage_ptr()

    def _storage_ptr(self) -> int:
        first = self.pool.layer_streams[0][0].name
        return self.pool.storage[0][first].data_ptr()

    def fits(self, table: BlockTable) -> bool:
        """Whether this step's buffers can serve `table` now."""
        return len(table.blocks) <= self.max_blocks and self._storage_ptr() == self.storage_ptr

    def load(self, tokens: torch.Tensor, ctx: StepContext) -> None:
        """Copy one step's inputs into the static buffers (host -> device copies of a few ints)."""
        table = ctx.table
        self.tokens.copy_(tokens, non_blocking=True)
        self.positions.copy_(ctx.positions, non_blocking=True)
        self.new_slots.copy_(ctx.new_slots, non_blocking=True)
        blocks = torch.tensor(table.blocks, dtype=torch.int32)
        self.block_table[: len(table.blocks)].copy_(blocks, non_blocking=True)
        for window, dst in self.ranges.items():
            start = 0 if window is None else max(0, table.length - window)
            dst.copy_(torch.tensor([start, table.length], dtype=torch.int32), non_blocking=True)

    def forward(self) -> torch.Tensor:
        """Logits [1, V] of the token in the buffers (every op on the device, no host sync)."""
        cos, sin = rope_cos_sin(self.model.spec.rope, self.positions, self.dtype)
        static = StaticAttention(self.block_table, self.ranges)
        ctx = StepContext(self.table, self.new_slots, self.positions, cos, sin, static=static)
        provider = expert_provider(self.model)
        with provider.static_step() if provider is not None else nullcontext():
            return self.model.forward_layers(self.tokens, ctx, last_only=True)

    def prepare(self, tokens: torch.Tensor, ctx: StepContext) -> None:
        """Make the step ready to `run` (nothing to do for the uncaptured step)."""

    def run(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        self.load(tokens, ctx)
        return self.forward()


class CudaGraphDecode(StaticDecode):
    """`StaticDecode.forward` captured as a CUDA graph; `run` loads the inputs and replays."""

    def __init__(self, model: DecodeModel, table: BlockTable, max_blocks: int, device: torch.device) -> None:
        super().__init__(model, table, max_blocks, device)
        self.provider = expert_provider(model)
        self.epoch = self.provider.graph_epoch if self.provider is not None else 0
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def prepare(self, tokens: torch.Tensor, ctx: StepContext) -> None:
        """Warm up on a side stream (the caching allocator and Triton's compile need it), then
        capture. Each pass writes this step's K/V to its slot: the same values every time."""
        self.load(tokens, ctx)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.forward()

    def fits(self, table: BlockTable) -> bool:
        provider = expert_provider(self.model)
        epoch = provider.graph_epoch if provider is not None else 0
        return super().fits(table) and provider is self.provider and epoch == self.epoch

    def run(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        self.load(tokens, ctx)
        self.graph.replay()
        assert self.logits is not None
        return self.logits.clone()  # the buffer is overwritten by the next replay


def expert_provider(model: DecodeModel) -> Any:
    """The expert provider of `model`'s MoE layers (None: no MoE layer)."""
    from ..model.moe import MoEBlock

    return next((layer.mlp.provider for layer in model.layers if isinstance(layer.mlp, MoEBlock)), None)


class DecodeGraphs:
    """The model's captured decode step, recaptured when it cannot serve a step; counters for
    tests and benchmarks (`captures`, `replays`, `reruns`). `step_cls` StaticDecode runs the
    same static step uncaptured (how the tests check it on CPU)."""

    def __init__(self, model: DecodeModel, step_cls: type[StaticDecode] = CudaGraphDecode) -> None:
        self.model, self.step_cls = model, step_cls
        self.current: StaticDecode | None = None
        self.captures = 0
        self.replays = 0
        self.reruns = 0
        self.failed: str | None = None  # why a capture failed (then every step is eager)

    @property
    def wanted(self) -> bool:
        """Whether a replay is worth trying for the next step (the expert store's say: the
        tiered one declines while its recent steps missed tier 1); never after a failed capture."""
        if self.failed is not None:
            return False
        provider = expert_provider(self.model)
        return provider is None or provider.graph_wanted

    def run(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """Logits [1, V] of the decode step, or None when the expert store found the replay
        wrong (a routed expert missing from tier 1) or the capture failed (logged once; `failed`
        says why, and no replay is wanted again): the caller computes the step eagerly."""
        table = ctx.table
        if self.current is None or not self.current.fits(table):
            blocks = max(64, 1 << max(0, len(table.blocks) - 1).bit_length())
            self.current = None  # free the old graph's memory pool first
            step = self.step_cls(self.model, table, blocks, tokens.device)
            try:
                step.prepare(tokens, ctx)
            except RuntimeError as e:
                # A kernel that cannot be captured here (a driver, torch or Triton version this
                # repository never ran): decode eagerly from now on rather than fail the step.
                self.failed = f"{type(e).__name__}: {e}"
                logger.warning("capturing the decode step failed; decoding eagerly from now on (%s)", e)
                return None
            self.current = step
            self.captures += 1
        self.replays += 1
        logits = self.current.run(tokens, ctx)
        provider = expert_provider(self.model)
        if provider is not None and not provider.finish_static_step():
            self.reruns += 1
            return None
        return logits
