"""Small building blocks: RMSNorm, rotary embeddings, the per-step attention context.

Letters: T new tokens this step, S cached tokens after this step (keys), H hidden size,
N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import norm_triton
from ..kernels.paged_attention import Chunk, position_chunks
from ..spec import RopeSpec
from .kv import BlockTable


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as the reference models do (on CUDA one fused Triton kernel:
    `norm_triton`)."""

    def __init__(self, dim: int, eps: float, *, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32
        self._eps: torch.Tensor | None = None

    def _eps_for(self, x: torch.Tensor) -> torch.Tensor:
        """eps as a one-element tensor on x's device (kept: an op argument, not a new tensor)."""
        if self._eps is None or self._eps.device != x.device:
            with torch.inference_mode(False):
                self._eps = torch.full((1,), self.eps, dtype=torch.float32, device=x.device)
        return self._eps

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether `norm_triton`'s kernel serves `x` (CUDA, a weight it takes, the kernel checked)."""
        fusable = self.weight_in_fp32 or self.weight.dtype == x.dtype
        return x.is_cuda and fusable and norm_triton.kernel_ok(x.device)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it): one kernel on CUDA (`norm_triton.add_rms_norm`)."""
        if self._fused(x) and residual.dtype == x.dtype:
            return norm_triton.add_rms_norm(x, residual, self.weight, self.eps, self.weight_in_fp32)
        s = x + residual
        return s, self.forward(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self._fused(x):
            # One kernel instead of ~7 (`norm_triton`): the same arithmetic but for the order of
            # the sum of squares.
            return norm_triton.rms_norm(x, self.weight, self.eps, self.weight_in_fp32)
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # x * rsqrt(|x|^2 / H + eps) * w in four cheap ops: ATen's rms_norm is a composite of
            # ~10 (its mean and eps add wrap Python scalars into tensors), ~60 vs ~35 us for one
            # decode row here. Equal to the formula below up to rounding of the sum of squares.
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            inv = torch.addcmul(self._eps_for(x), norm, norm, value=1.0 / x.shape[-1]).rsqrt_()
            return x * inv * self.weight
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight * h).to(dtype)
        return self.weight * h.to(dtype)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` without nn.Module's call machinery when it is a plain nn.Linear (~2-5 us per
    call on these CPUs, a few per layer per decoded token); other modules (Int8Linear) as usual."""
    if type(module) is nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module(x)


def rope_cos_sin(
    rope: RopeSpec, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rot_dim/2] for integer `positions [T]`."""
    freqs = positions.float()[:, None] * _inv_freq_on(rope, positions.device)[None, :]
    return (freqs.cos() * rope.attention_scaling).to(dtype), (freqs.sin() * rope.attention_scaling).to(dtype)


_INV_FREQ: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _inv_freq_on(rope: RopeSpec, device: torch.device) -> torch.Tensor:
    """`rope.inv_freq` on `device`, copied there once: a host -> device copy inside a CUDA-graph
    capture is refused (and would be a copy per decoded token outside one)."""
    if rope.inv_freq.device == device:
        return rope.inv_freq
    key = (id(rope.inv_freq), device)
    cached = _INV_FREQ.get(key)
    if cached is None or cached[0] is not rope.inv_freq:  # an id reused by a new tensor
        cached = (rope.inv_freq, rope.inv_freq.to(device))
        _INV_FREQ[key] = cached
    return cached[1]


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width tables for `apply_rope_half`: cos [T, 1, rot] = (cos, cos), sin = (-sin, sin)."""
    return torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([-sin, sin], dim=-1)[:, None, :]


def apply_rope_half(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """`apply_rope` for the half layout in three ops: x * (c, c) + (x2, x1) * (-s, s).

    The same products and sums as the reference's ``x * cos + rotate_half(x) * sin`` (negation is
    exact), so bit for bit the same result. x [T, heads, rot]; tables from `rope_tables`.
    """
    return x * cos2 + x.roll(x.shape[-1] // 2, dims=-1) * sin2


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate `x [T, heads, rot_dim]` by position; cos/sin [T, rot_dim/2].

    Half layout rotates (x[:d/2], x[d/2:]) pairs. Interleaved layout (DeepSeek) rotates
    (x[0::2], x[1::2]) pairs and, like the reference, returns the result de-interleaved (evens
    first); queries and keys get the same permutation, so their dot products are unchanged.
    """
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@dataclass(frozen=True)
class StaticAttention:
    """Device-side inputs of decode attention in a static step: the sequence's block table
    (int32 [max_blocks], padded) and per sliding window (None: all) the attended positions
    [start, stop) as int32 [2]."""

    block_table: torch.Tensor
    ranges: dict[int | None, torch.Tensor]


@dataclass
class StepContext:
    """What every layer needs to know about the current forward step of one sequence."""

    table: BlockTable
    new_slots: torch.Tensor  # [T] KV slots the new tokens are written to
    positions: torch.Tensor  # [T] absolute positions of the new tokens
    cos: torch.Tensor  # [T, rot/2]
    sin: torch.Tensor
    # Set by a static (CUDA-graph) decode step: attention reads the cache through the Triton
    # kernel from these device tensors instead of host-side chunks (`cuda_graph.StaticDecode`).
    static: StaticAttention | None = None
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    _chunks: dict[int | None, list[Chunk]] = field(default_factory=dict)
    _tables: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_keys(self) -> int:
        return self.table.length

    @property
    def is_decode(self) -> bool:
        """One new token: attention reads the cache in place (`paged_attention`)."""
        return self.positions.shape[0] == 1

    @property
    def rope_half(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_tables` of this step (computed once, shared by every layer)."""
        if self._tables is None:
            self._tables = rope_tables(self.cos, self.sin)
        return self._tables

    def chunks(self, sliding_window: int | None) -> list[Chunk]:
        """`position_chunks` of the cached positions a decode token attends to: all of them, or
        the last `sliding_window` (computed once per step and window, shared by every layer)."""
        if sliding_window not in self._chunks:
            t = self.table
            start = 0 if sliding_window is None else max(0, t.length - sliding_window)
            self._chunks[sliding_window] = position_chunks(t.blocks, t.pool.block_size, start, t.length)
        return self._chunks[sliding_window]

    def mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """Boolean [T, S] mask (True = attend), or None when every cached key is visible."""
        if sliding_window not in self._masks:
            t, s = self.positions.shape[0], self.num_keys
            needs_causal = t > 1
            needs_window = sliding_window is not None and s > sliding_window
            if not (needs_causal or needs_window):
                self._masks[sliding_window] = None
            else:
                q = self.positions[:, None]
                k = torch.arange(s, device=q.device)[None, :]
                allowed = k <= q
                if sliding_window is not None:
                    allowed &= k > q - sliding_window
                self._masks[sliding_window] = allowed
        return self._masks[sliding_window]
