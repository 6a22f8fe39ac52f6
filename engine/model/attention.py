"""Attention over the paged KV cache: grouped-query attention and DeepSeek's latent attention.

Letters: T new tokens, S keys (cached + new), H hidden, N query heads, K kv heads, D head dim,
R kv latent rank (MLA), P rotary dims (MLA).
Module attribute names follow the Hugging Face checkpoints so that weight mapping stays trivial.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.paged_attention import chunk_views, decode_gqa, decode_mla, heads_first_views
from ..spec import AttentionSpec
from .kv import StreamSpec
from .layers import RMSNorm, StepContext, apply_rope, apply_rope_half, linear


def _linear(in_f: int, out_f: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(in_f, out_f, bias=bias, device="meta")
    layer.requires_grad_(False)
    return layer


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention. q [N, T, D], k [K, S, D], v [K, S, Dv], mask [T, S] bool -> [N, T, Dv].

    With `sinks [N]`, each head has one extra learned logit that takes probability mass but
    contributes no value (gpt-oss).
    """
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[0] != k.shape[0]
        )
    # Group the query heads of each kv head as rows of one matrix: K/V are never repeated.
    n, t, d = q.shape
    kv = k.shape[0]
    g = n // kv
    scores = torch.matmul(q.reshape(kv, g * t, d), k.transpose(-1, -2)).view(kv, g, t, -1) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # [K, G, T, S]
    sink = sinks.to(scores.dtype).view(kv, g, 1, 1).expand(kv, g, t, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype).reshape(kv, g * t, -1), v).view(n, t, -1)


class GQAAttention(nn.Module):
    """Grouped-query attention with the variants of Mixtral, Qwen2/3-MoE, OLMoE and gpt-oss."""

    def __init__(self, spec: AttentionSpec, hidden: int, eps: float, layer: int) -> None:
        super().__init__()
        self.spec, self.layer = spec, layer
        n, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = _linear(hidden, n * d, spec.qkv_bias)
        self.k_proj = _linear(hidden, kv * d, spec.qkv_bias)
        self.v_proj = _linear(hidden, kv * d, spec.qkv_bias)
        self.o_proj = _linear(n * d, hidden, spec.o_bias)
        if spec.qk_norm == "per_head":
            self.q_norm, self.k_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        elif spec.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(n * d, eps), RMSNorm(kv * d, eps)
        if spec.sinks:
            self.sinks = nn.Parameter(torch.empty(n, device="meta"), requires_grad=False)
        self._fused: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._fused_ptrs: tuple[int, ...] = ()

    def kv_streams(self) -> tuple[StreamSpec, ...]:
        s = self.spec
        return (StreamSpec("k", (s.num_kv_heads, s.head_dim)), StreamSpec("v", (s.num_kv_heads, s.head_dim)))

    def _qkv(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The q/k/v weights as one [(N + 2K) D, H] matrix (and bias), or None when a projection
        is not a float nn.Linear (int8). Built on first use; q_proj/k_proj/v_proj.weight then
        become views into it, so nothing is held twice and the state dict is unchanged. One GEMV
        instead of three per decode token."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not all(type(p) is nn.Linear for p in projs):
            return None
        fused = self._fused
        if fused is not None and all(
            p.weight.data_ptr() == ptr for p, ptr in zip(projs, self._fused_ptrs, strict=True)
        ):
            return fused
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: parameters
            if all(p.weight.stride(0) == 1 for p in projs):  # [in, out] buffers (decode layout)
                weight = torch.cat([p.weight.t() for p in projs], dim=1).t()
            else:
                weight = torch.cat([p.weight for p in projs])
            bias = torch.cat([p.bias for p in projs]) if self.spec.qkv_bias else None
            start = 0
            for p in projs:
                n = p.weight.shape[0]
                p.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
                if bias is not None:
                    p.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
                start += n
        self._fused = (weight, bias)
        self._fused_ptrs = tuple(p.weight.data_ptr() for p in projs)
        return self._fused

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        s = self.spec
        t, n, kv, d = x.shape[0], s.num_heads, s.num_kv_heads, s.head_dim
        fused = self._qkv()
        cos2, sin2 = ctx.rope_half
        if fused is not None and s.qk_norm == "none" and s.clip_qkv is None:
            # One projection, one rotation of q and k together (they are adjacent heads).
            qkv = F.linear(x, *fused).view(t, n + 2 * kv, d)
            qk = apply_rope_half(qkv[:, : n + kv], cos2, sin2)  # [T, N + K, D]
            q, k, v = qk[:, :n], qk[:, n:], qkv[:, n + kv :]
        else:
            if fused is not None:
                q, k, v = F.linear(x, *fused).split([n * d, kv * d, kv * d], dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if s.qk_norm == "full":
                q, k = self.q_norm(q), self.k_norm(k)
            if s.clip_qkv is not None:
                q, k, v = (z.clamp(-s.clip_qkv, s.clip_qkv) for z in (q, k, v))
            q, k, v = q.view(t, n, d), k.view(t, kv, d), v.view(t, kv, d)  # [T, N|K, D]
            if s.qk_norm == "per_head":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope_half(q, cos2, sin2), apply_rope_half(k, cos2, sin2)
        ctx.table.write(self.layer, "k", ctx.new_slots, k)
        ctx.table.write(self.layer, "v", ctx.new_slots, v)
        sinks = self.sinks if s.sinks else None
        if ctx.static is not None:  # a captured decode step: the Triton kernel, device-side table
            pool = ctx.table.pool
            out = static_decode(
                ctx, s.sliding_window, q.reshape(kv, n // kv, d), pool.flat(self.layer, "k"),
                pool.flat(self.layer, "v"), s.scaling, sinks,
            )  # fmt: skip
            return linear(self.o_proj, out.reshape(1, n * d))
        if ctx.is_decode:  # read the cached blocks in place
            chunks = ctx.chunks(s.sliding_window)
            pool = ctx.table.pool
            keys = heads_first_views(pool.flat(self.layer, "k"), chunks, ctx.table.slots)  # [1, K, n_c, D]
            values = heads_first_views(pool.flat(self.layer, "v"), chunks, ctx.table.slots)
            if keys[0].dtype != q.dtype:
                keys, values = [z.to(q.dtype) for z in keys], [z.to(q.dtype) for z in values]
            return linear(self.o_proj, decode_gqa(q, keys, values, s.scaling, sinks))  # [1, N D] in
        keys = ctx.table.read(self.layer, "k").to(q.dtype).transpose(0, 1)  # [K, S, D]
        values = ctx.table.read(self.layer, "v").to(q.dtype).transpose(0, 1)
        out = attend(
            q.transpose(0, 1), keys, values, ctx.mask(s.sliding_window), s.scaling, sinks
        )  # [N, T, D]
        return linear(self.o_proj, out.transpose(0, 1).reshape(t, n * d))


class MLAAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention; the cache holds only the latent and rotary key.

    Scores use the absorbed form: q_nope is projected into latent space by the key half of
    kv_b_proj, so keys/values are never expanded per head; the value half is applied to the
    attention-weighted latent afterwards. This is the same function as expanding K and V.
    """

    def __init__(
        self, spec: AttentionSpec, hidden: int, eps: float, layer: int, rope_interleaved: bool
    ) -> None:
        super().__init__()
        self.spec, self.layer, self.rope_interleaved = spec, layer, rope_interleaved
        n = spec.num_heads
        qk_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank is None:
            self.q_proj = _linear(hidden, n * qk_dim, False)
        else:
            self.q_a_proj = _linear(hidden, spec.q_lora_rank, spec.qkv_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, 1e-6)
            self.q_b_proj = _linear(spec.q_lora_rank, n * qk_dim, False)
        self.kv_a_proj_with_mqa = _linear(hidden, spec.kv_lora_rank + spec.qk_rope_head_dim, spec.qkv_bias)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, 1e-6)
        self.kv_b_proj = _linear(spec.kv_lora_rank, n * (spec.qk_nope_head_dim + spec.v_head_dim), False)
        self.o_proj = _linear(n * spec.v_head_dim, hidden, spec.o_bias)

    def kv_streams(self) -> tuple[StreamSpec, ...]:
        s = self.spec
        return (StreamSpec("latent", (s.kv_lora_rank,)), StreamSpec("k_rope", (s.qk_rope_head_dim,)))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        s = self.spec
        t, n = x.shape[0], s.num_heads
        if s.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, n, s.qk_nope_head_dim + s.qk_rope_head_dim)
        q_nope, q_rope = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        q_rope = apply_rope(q_rope, ctx.cos, ctx.sin, interleaved=self.rope_interleaved)
        k_rope = apply_rope(k_rope[:, None, :], ctx.cos, ctx.sin, interleaved=self.rope_interleaved)[:, 0]
        ctx.table.write(self.layer, "latent", ctx.new_slots, latent)
        ctx.table.write(self.layer, "k_rope", ctx.new_slots, k_rope)

        w = self.kv_b_proj.weight.view(n, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        w_k, w_v = w.split([s.qk_nope_head_dim, s.v_head_dim], dim=1)  # [N, Dn, R], [N, Dv, R]
        q_latent = torch.einsum("tnd,ndr->ntr", q_nope, w_k)  # [N, T, R]
        if ctx.static is not None:  # a captured decode step: one kv head, key = (latent, k_rope)
            pool = ctx.table.pool
            latent_flat = pool.flat(self.layer, "latent")[:, None]  # [slots, 1, R]
            ctx_latent = static_decode(
                ctx, s.sliding_window, q_latent[:, 0][None], latent_flat, latent_flat, s.scaling, None,
                q2=q_rope[0][None], k2=pool.flat(self.layer, "k_rope")[:, None],
            )[0]  # fmt: skip
            out = torch.einsum("nr,nvr->nv", ctx_latent, w_v)  # [N, Dv]
            return self.o_proj(out.reshape(1, n * s.v_head_dim))
        if ctx.is_decode:  # read the cached blocks in place
            chunks = ctx.chunks(s.sliding_window)
            latents_r = _views(ctx, self.layer, "latent", chunks, q.dtype)  # [n_c, R] each
            k_ropes_r = _views(ctx, self.layer, "k_rope", chunks, q.dtype)  # [n_c, P] each
            ctx_latent = decode_mla(q_latent[:, 0], q_rope[0], latents_r, k_ropes_r, s.scaling)  # [N, R]
            out = torch.einsum("nr,nvr->nv", ctx_latent, w_v)  # [N, Dv]
            return self.o_proj(out.reshape(1, n * s.v_head_dim))
        latents = ctx.table.read(self.layer, "latent").to(q.dtype)  # [S, R]
        k_ropes = ctx.table.read(self.layer, "k_rope").to(q.dtype)  # [S, P]
        scores = torch.matmul(q_latent, latents.T) + torch.matmul(q_rope.transpose(0, 1), k_ropes.T)
        scores = scores * s.scaling  # [N, T, S]
        mask = ctx.mask(s.sliding_window)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        ctx_latent = torch.matmul(probs, latents)  # [N, T, R]
        out = torch.einsum("ntr,nvr->tnv", ctx_latent, w_v)  # [T, N, Dv]
        return self.o_proj(out.reshape(t, n * s.v_head_dim))


def _views(ctx: StepContext, layer: int, stream: str, chunks: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """The cached chunks of one stream, as views of the pool where contiguous (`chunk_views`)."""
    views = chunk_views(ctx.table.pool.flat(layer, stream), chunks, ctx.table.slots)
    return views if views[0].dtype == dtype else [v.to(dtype) for v in views]


def static_decode(
    ctx: StepContext,
    window: int | None,
    q1: torch.Tensor,
    k1: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    sinks: torch.Tensor | None,
    **key2: torch.Tensor,
) -> torch.Tensor:
    """Decode attention of a static step through the Triton kernel (`paged_triton`)."""
    from ..kernels.paged_triton import paged_decode  # triton is only needed (and imported) here

    static = ctx.static
    assert static is not None
    return paged_decode(
        q1, k1, v, static.block_table, static.ranges[window], scaling, ctx.table.pool.block_size,
        sinks=sinks, **key2,
    )  # fmt: skip
