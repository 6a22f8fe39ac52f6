"""Decode attention over the paged KV cache, reading the blocks where they are.

A sequence's positions live in fixed-size blocks of the pool. Consecutive block ids are
consecutive slots of the pool's storage, so a *run* of consecutive blocks is one strided view
of it: decode attention (one query token) reads views and never gathers the cache into a copy.
The pool hands out the block after a table's last one when it is free (`BlockTable.reserve`),
so a sequence is usually one run; forks, rollbacks and copy-on-write split it into a few.

The attended positions are cut into chunks at fixed multiples of `CHUNK_TOKENS` (not at run
boundaries), so the arithmetic depends only on the positions, never on where the blocks lie: a
session restored from an anchor into other blocks computes bit for bit the same logits. A chunk
within one run is a view; only a chunk that straddles a run break is gathered (at most
`CHUNK_TOKENS` positions copied per break, never the whole cache).

Per chunk the partial result comes with its log-sum-exp, and chunks merge exactly:
``out = sum_c exp(lse_c - lse) * out_c`` with ``lse = logsumexp_c(lse_c)``. A gpt-oss attention
sink is one more term of that merge (a logit with no value). GQA groups the query heads of a kv
head as the rows of one query block (`q [K, G, D]` against `k [K, S, D]`), so repeated K/V are
never materialised. MLA attends in the latent space against the cached latent and rotary key
views (two score matmuls, one value matmul per run). A sliding window reads only its last
`window` positions.

On CPU the GQA kernel is ATen's flash attention for CPU (it returns the log-sum-exp); elsewhere,
or without it, scores are computed per run by matmul, softmaxed once over the concatenation
(exact) and applied per run. The CUDA-graph path uses the Triton kernel in `paged_triton.py`
instead (static shapes, block table on the device).

Letters: N query heads, K kv heads, G = N / K, D head dim, S cached positions, R latent rank,
P rotary dims.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

Run = tuple[int, int]  # (first slot in the pool's flat storage, number of positions)
Chunk = tuple[int, int, "int | None"]  # positions [p0, p1) and their first slot if contiguous

CHUNK_TOKENS = 1024
"""Decode attention reads positions in chunks cut at multiples of this. Larger chunks mean fewer
kernel calls (one per chunk per layer) but more copying when a chunk straddles a run break."""

_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def slot_runs(blocks: Sequence[int], block_size: int, start: int, stop: int) -> list[Run]:
    """The maximal runs of consecutive slots holding positions [start, stop) of a sequence whose
    positions live in `blocks` (position p in block `blocks[p // block_size]`)."""
    if stop <= start:
        return []
    first, last = start // block_size, (stop - 1) // block_size
    ids = np.asarray(blocks[first : last + 1], dtype=np.int64)
    # A run breaks wherever the next block is not the one right after.
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    runs: list[Run] = []
    for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), len(ids)], strict=True):
        lo = max(start, (first + a) * block_size)
        hi = min(stop, (first + b) * block_size)
        runs.append((int(ids[a]) * block_size + lo - (first + a) * block_size, hi - lo))
    return runs


def position_chunks(
    blocks: Sequence[int], block_size: int, start: int, stop: int, chunk: int = CHUNK_TOKENS
) -> list[Chunk]:
    """Positions [start, stop) cut at multiples of `chunk`, each with its first slot when its
    positions are consecutive slots (one run), else None (it must be gathered)."""
    out: list[Chunk] = []
    p = start
    while p < stop:
        q = min(stop, (p // chunk + 1) * chunk)
        runs = slot_runs(blocks, block_size, p, q)
        out.append((p, q, runs[0][0] if len(runs) == 1 else None))
        p = q
    return out


def chunk_views(flat: torch.Tensor, chunks: Sequence[Chunk], slots: torch.Tensor) -> list[torch.Tensor]:
    """Per chunk `[n, *shape]` of slot-addressed storage `flat [slots, *shape]`: a view when the
    chunk is contiguous, else a gather of its positions' `slots` (slot of every position)."""
    return [
        flat.narrow(0, first, p1 - p0) if first is not None else flat.index_select(0, slots[p0:p1])
        for p0, p1, first in chunks
    ]


def heads_first_views(flat: torch.Tensor, chunks: Sequence[Chunk], slots: torch.Tensor) -> list[torch.Tensor]:
    """Per chunk `[1, K, n, D]` of slot-addressed GQA storage `flat [slots, K, D]`, the layout the
    attention kernels take: one strided view (one op) when the chunk is contiguous, else a gather
    of its positions' `slots` seen heads-first."""
    s_slot, s_head, s_dim = flat.stride()
    kv, d = flat.shape[1], flat.shape[2]
    out = []
    for p0, p1, first in chunks:
        n = p1 - p0
        if first is None:
            out.append(flat.index_select(0, slots[p0:p1]).transpose(0, 1)[None])
        else:
            offset = flat.storage_offset() + first * s_slot
            out.append(flat.as_strided((1, kv, n, d), (n * s_slot, s_head, s_slot, s_dim), offset))
    return out


def _merge(
    outs: list[torch.Tensor], lses: list[torch.Tensor], sinks: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Exact merge of per-run softmax results `outs[r] [..., Dv]` with log-sum-exps `lses[r] [...]`
    (fp32); a sink adds probability mass with no value."""
    if len(outs) == 1 and sinks is None:
        return outs[0] if outs[0].dtype == dtype else outs[0].to(dtype)
    parts = list(lses)
    if sinks is not None:
        parts.append(sinks.float().view(lses[0].shape))
    lse = torch.stack(parts)  # [R(+1), ...]
    scale = torch.softmax(lse, dim=0)[: len(outs)]  # exp(lse_r - logsumexp)
    out = outs[0].float() * scale[0, ..., None]
    for r in range(1, len(outs)):
        out += outs[r].float() * scale[r, ..., None]
    return out.to(dtype)


def decode_gqa(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token against the cached chunks. q [N, D] (or [1, N, D]), keys[c] [1, K, n_c, D],
    values[c] [1, K, n_c, Dv] (`heads_first_views`), sinks [N] or None -> [1, N * Dv] (the
    heads of the token side by side, what the output projection takes)."""
    n_heads, d = q.shape[-2], q.shape[-1]
    kv_heads = keys[0].shape[1]
    qg = q.view(1, kv_heads, n_heads // kv_heads, d)  # [1, K, G, D]: query heads grouped by kv head
    if _flash_cpu is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        outs, lses = [], []
        for k, v in zip(keys, values, strict=True):
            out, lse = _flash_cpu(qg, k, v, scale=scaling)  # [1, K, G, Dv], [1, K, G] fp32
            outs.append(out)
            lses.append(lse)
        return _merge(outs, lses, sinks, q.dtype).reshape(1, -1)
    if len(keys) == 1 and sinks is None:
        return F.scaled_dot_product_attention(qg, keys[0], values[0], scale=scaling).reshape(1, -1)
    scores = [torch.matmul(qg, k.transpose(-1, -2)) for k in keys]  # [1, K, G, n_c]
    return _softmax_apply(scores, list(values), scaling, sinks, q.dtype).reshape(1, -1)


def decode_mla(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latents: Sequence[torch.Tensor],
    k_ropes: Sequence[torch.Tensor],
    scaling: float,
) -> torch.Tensor:
    """DeepSeek latent attention for one query token. q_latent [N, R] (q_nope absorbed into the
    latent space), q_rope [N, P], latents[c] [n_c, R], k_ropes[c] [n_c, P] -> the attention-
    weighted latent [N, R]."""
    scores = [
        torch.matmul(q_latent, lat.T) + torch.matmul(q_rope, kr.T)  # [N, n_r]
        for lat, kr in zip(latents, k_ropes, strict=True)
    ]
    return _softmax_apply(scores, list(latents), scaling, None, q_latent.dtype)


def _softmax_apply(
    scores: list[torch.Tensor],
    values: list[torch.Tensor],
    scaling: float,
    sinks: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """softmax(scaling * concat(scores) [+ sink]) applied to the per-run values, run by run:
    scores[r] [..., n_r], values[r] [(...), n_r, Dv] -> [..., Dv]."""
    logits = torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]
    logits = logits.float() * scaling
    if sinks is not None:
        sink = sinks.float().view(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1).to(dtype)
    out = None
    start = 0
    for v in values:
        n = v.shape[-2]
        part = torch.matmul(probs[..., start : start + n], v)
        out = part if out is None else out + part
        start += n
    assert out is not None
    return out
