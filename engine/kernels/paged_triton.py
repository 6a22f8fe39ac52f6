"""Paged decode attention as a Triton kernel: static shapes, block table and length on the device.

The CUDA-graph decode step (`cuda_graph.py`) cannot cut the cache into chunks on the host as the
eager path does (`paged_attention.py`): shapes must not change between replays. This kernel
takes the sequence's block table and its attended range [start, stop) as device tensors, so one
captured launch serves every length up to the table's capacity.

Flash-decoding: the grid is (kv heads, SPLITS). Each program walks its share of the positions in
steps of BLOCK_N, maps each position to its slot through the block table (the blocks are read
where they are), and keeps an online softmax (running max m, sum l, weighted values acc) for the
G query heads of its kv head: GQA without repeated K/V. `merge_splits` combines the splits
exactly, a gpt-oss sink being one more term of the denominator. MLA (DeepSeek) runs through the
same kernel as one kv head whose key is two cached streams (latent and rotary key, `q2`/`k2`)
and whose value is the latent.

Never run on a GPU in this repository's CI (no GPU there): the kernel's arithmetic is checked on
CPU by Triton's interpreter (TRITON_INTERPRET=1, tests/test_paged_triton.py); the launch on a
device is covered by `-m cuda` tests (tests/test_cuda_decode.py).

Letters: K kv heads, G query heads per kv head, D key dims, Dv value dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(
    Q1, Q2, K1, K2, V, Table, Meta, Acc, M, L,
    scaling,
    s_q1h, s_q1g, s_q2h, s_q2g,
    s_k1s, s_k1h, s_k2s, s_k2h, s_vs, s_vh,
    s_ah, s_as, s_ag, s_mh, s_ms,
    G: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    G_PAD: tl.constexpr, D1_PAD: tl.constexpr, D2_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_K2: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    split = tl.program_id(1)
    start = tl.load(Meta)
    stop = tl.load(Meta + 1)
    per_split = tl.cdiv(tl.cdiv(stop - start, SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(stop, lo + per_split)

    g = tl.arange(0, G_PAD)
    d1 = tl.arange(0, D1_PAD)
    dv = tl.arange(0, DV_PAD)
    q1 = tl.load(
        Q1 + h * s_q1h + g[:, None] * s_q1g + d1[None, :],
        mask=(g[:, None] < G) & (d1[None, :] < D1),
        other=0.0,
    )
    if HAS_K2:
        d2 = tl.arange(0, D2_PAD)
        q2 = tl.load(
            Q2 + h * s_q2h + g[:, None] * s_q2g + d2[None, :],
            mask=(g[:, None] < G) & (d2[None, :] < D2),
            other=0.0,
        )

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    for p0 in range(lo, hi, BLOCK_N):
        pos = p0 + tl.arange(0, BLOCK_N)
        live = pos < hi
        block = tl.load(Table + pos // BLOCK_SIZE, mask=live, other=0)
        slot = (block * BLOCK_SIZE + pos % BLOCK_SIZE).to(tl.int64)
        k1 = tl.load(
            K1 + slot[:, None] * s_k1s + h * s_k1h + d1[None, :],
            mask=live[:, None] & (d1[None, :] < D1),
            other=0.0,
        )
        if IEEE:
            scores = tl.dot(q1, tl.trans(k1), input_precision="ieee")
        else:
            scores = tl.dot(q1, tl.trans(k1))
        if HAS_K2:
            k2 = tl.load(
                K2 + slot[:, None] * s_k2s + h * s_k2h + d2[None, :],
                mask=live[:, None] & (d2[None, :] < D2),
                other=0.0,
            )
            if IEEE:
                scores += tl.dot(q2, tl.trans(k2), input_precision="ieee")
            else:
                scores += tl.dot(q2, tl.trans(k2))
        scores = tl.where(live[None, :], scores * scaling, float("-inf"))  # [G_PAD, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            V + slot[:, None] * s_vs + h * s_vh + dv[None, :],
            mask=live[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    keep = g < G
    tl.store(
        Acc + h * s_ah + split * s_as + g[:, None] * s_ag + dv[None, :],
        acc,
        mask=keep[:, None] & (dv[None, :] < DV),
    )
    tl.store(M + h * s_mh + split * s_ms + g, m_i, mask=keep)
    tl.store(L + h * s_mh + split * s_ms + g, l_i, mask=keep)


def _pad(n: int) -> int:
    """The power of two >= max(n, 16) (tl.dot takes dimensions of at least 16)."""
    return max(16, triton.next_power_of_2(n))


def paged_decode(
    q1: torch.Tensor,
    k1: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    meta: torch.Tensor,
    scaling: float,
    block_size: int,
    *,
    q2: torch.Tensor | None = None,
    k2: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    splits: int = 8,
    block_n: int = 32,
) -> torch.Tensor:
    """Attention of one query token over positions [meta[0], meta[1]) of a paged cache.

    q1 [K, G, D1] (and q2 [K, G, D2] with k2); k1 [slots, K, D1], k2 [slots, K, D2], v
    [slots, K, Dv]: slot-addressed pool storage (`BlockPool.flat`); table int32 [blocks] (the
    sequence's block ids, padded); meta int32 [2]; sinks [K * G] or None -> [K, G, Dv] in v's
    dtype. Shapes do not depend on the length: CUDA-graph capturable.
    """
    kv, g, d1 = q1.shape
    dv = v.shape[-1]
    acc = torch.empty(kv, splits, g, dv, dtype=torch.float32, device=q1.device)
    m = torch.empty(kv, splits, g, dtype=torch.float32, device=q1.device)
    lsum = torch.empty_like(m)
    has_k2 = q2 is not None and k2 is not None
    q2_, k2_ = (q2, k2) if has_k2 else (q1, k1)
    d2 = q2_.shape[-1]
    _split_kernel[(kv, splits)](
        q1, q2_, k1, k2_, v, table, meta, acc, m, lsum,
        scaling,
        q1.stride(0), q1.stride(1), q2_.stride(0), q2_.stride(1),
        k1.stride(0), k1.stride(1), k2_.stride(0), k2_.stride(1), v.stride(0), v.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        G=g, D1=d1, D2=d2, DV=dv,
        G_PAD=_pad(g), D1_PAD=_pad(d1), D2_PAD=_pad(d2), DV_PAD=_pad(dv),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLITS=splits, HAS_K2=has_k2,
        IEEE=q1.dtype == torch.float32,
    )  # fmt: skip
    return merge_splits(acc, m, lsum, sinks).to(v.dtype)


def merge_splits(
    acc: torch.Tensor, m: torch.Tensor, lsum: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Combine per-split online-softmax states: acc [K, S, G, Dv], m / lsum [K, S, G] -> [K, G, Dv].
    An empty split has m = -inf and contributes nothing; a sink [K * G] adds exp(sink) mass."""
    top = m.amax(dim=1)  # [K, G]
    if sinks is not None:
        sink = sinks.float().view(top.shape)
        top = torch.maximum(top, sink)
    scale = torch.exp(m - top[:, None])  # [K, S, G]
    den = (lsum * scale).sum(dim=1)
    if sinks is not None:
        den = den + torch.exp(sink - top)
    return (acc * scale[..., None]).sum(dim=1) / den[..., None]
