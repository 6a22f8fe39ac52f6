"""MXFP4 weight-only linear layers: products computed from the stored 4-bit form, never decoded
into a resident float copy (`expert_quant="compact"`).

The layout is FTW's ``mxfp4`` codec (`ftw.codecs.mxfp4.MXFP4Codec`, gpt-oss's on-disk form) with the
block axis flattened: ``blocks uint8 [N, K/2]`` (two E2M1 codes a byte, the even input feature in
the low nibble) and ``scales uint8 [N, K/32]`` (E8M0: 2**(s - 127) for each run of 32 inputs).
An expert held this way takes ~0.53 bytes a weight: 3.8x fewer than bf16, 7.5x fewer than fp32.

How a product is computed (`mxfp4_linear`):
- CUDA, few tokens (T <= `KERNEL_MAX_TOKENS`, i.e. decode), Triton installed:
  `gemv_triton.mxfp4_gemv`, a GEMV that reads each stored byte once, decodes both nibbles and the
  block's scale in registers and accumulates in fp32, so a decode step moves the stored bytes
  instead of decoded ones. The first use on a device checks it against the codec's decode
  (`kernel_ok`); a kernel that fails or disagrees is logged once and the decode path serves.
- CPU (`cpu_linear`): decode `DECODE_BLOCK` weights at a time into a per-thread scratch that stays
  in cache, with one gather per stored byte from `codecs.mxfp4.mxfp4_scaled_pairs` (a table of every
  byte's two values times every scale), and ``F.linear`` each row block. Decoding the whole
  weight at once wrote (and page-faulted) 8 fp32 bytes per stored byte: 0.21 GB/s of stored
  bytes for a [16384, 4096] projection one token at a time, against ~1 GB/s now (2-core Xeon).
- otherwise (prefill on CUDA, no Triton): decode the weight with the codec into the activation
  dtype, transiently, and ``F.linear``.
Every path but the kernel computes with the codec's decoded values (bit-equal to decoding at
load where the weight is one block).

The kernel's arithmetic is checked on CPU by Triton's interpreter (tests/test_gemv_triton.py);
the launch on a GPU by `-m cuda` tests.

Letters: T tokens, K input features, N output features.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..ftw.codecs import MXFP4_BLOCK, EncodedTensor, get_codec
from ..ftw.codecs.mxfp4 import mxfp4_scaled_pairs
from . import gemv_triton
from .scratch import thread_buffer

logger = logging.getLogger(__name__)

KERNEL_MAX_TOKENS = 8
"""Largest T computed by the GEMV kernel; more tokens (prefill) decode and run a float GEMM."""
DECODE_BLOCK = 1 << 18
"""Weights decoded at once on the CPU (1 MiB of fp32; its scratch, 1.5 MiB a thread). One token
through [16384, 4096] on the 2-core Xeon: blocks of 2^16 / 2^18 / 2^20 weights gave 0.7 / 1.0 /
1.0 GB/s of stored bytes (a block's fixed cost against its staying in cache)."""


def decode_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [N, K/2], scales [N, K/32] -> the float weight [N, K] in `dtype` (the codec's decode)."""
    n, half = blocks.shape
    nb = scales.shape[1]
    enc = EncodedTensor(
        "mxfp4", (n, 2 * half), {"blocks": blocks.view(n, nb, MXFP4_BLOCK // 2), "scales": scales}
    )
    return get_codec("mxfp4").decode(enc, dtype)


def kernel_ok(device: torch.device) -> bool:
    """Whether the GEMV kernel runs on `device` and agrees with the codec's decode (checked once
    per device; a failure is logged and the decode path is used)."""
    return device.type == "cuda" and gemv_triton.usable("mxfp4", device, _self_check)


def _self_check(device: torch.device) -> bool:
    g = torch.Generator().manual_seed(0)
    enc = get_codec("mxfp4").encode(torch.randn(48, 160, generator=g))
    blocks, scales = enc.parts["blocks"].reshape(48, 80).to(device), enc.parts["scales"].to(device)
    x = torch.randn(3, 160, generator=g).to(device)
    want = F.linear(x, decode_weight(blocks, scales, torch.float32))
    got = gemv_triton.mxfp4_gemv(x, blocks, scales)
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())))


def mxfp4_linear(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [T, K] @ W.T + bias`` for W [N, K] held as MXFP4 (`blocks [N, K/2]`, `scales [N, K/32]`)
    -> [T, N] in x.dtype (module doc: kernel for decode on CUDA, else decode + float GEMM)."""
    if x.dim() == 2 and x.shape[0] <= KERNEL_MAX_TOKENS and kernel_ok(x.device):
        y = gemv_triton.mxfp4_gemv(x, blocks, scales)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)
    if x.device.type == "cpu":
        y = cpu_linear(x, blocks, scales)
    else:  # one decode and one GEMM: a block loop would cost a launch per block on a GPU
        y = F.linear(x, decode_weight(blocks, scales, x.dtype))
    return y if bias is None else y + bias


def cpu_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ W.T`` -> [..., N] in x.dtype, W decoded `DECODE_BLOCK` weights (whole rows)
    at a time into a per-thread scratch: one integer gather per stored byte (its two values,
    scaled) from `codecs.mxfp4.mxfp4_scaled_pairs`. Values are the codec's decode into x.dtype; a weight
    of one block gives exactly ``F.linear(x, decode_weight(...))``."""
    n, half = blocks.shape
    nb = scales.shape[1]
    work = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32  # as the codec
    table = mxfp4_scaled_pairs(work, blocks.device)
    rows = max(1, min(n, DECODE_BLOCK // (2 * half)))
    index = thread_buffer("mxfp4 index", rows * half, torch.int32, blocks.device)  # table entries
    pairs = thread_buffer("mxfp4 pairs", rows * half, table.dtype, blocks.device)  # their values
    scale_index = thread_buffer("mxfp4 scales", rows * nb, torch.int32, blocks.device)
    out = None if rows == n else torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    for r0 in range(0, n, rows):
        r = min(rows, n - r0)
        # table entry of each byte: its block's scale byte * 256 + the byte
        s = scale_index[: r * nb].view(r, nb, 1).copy_(scales[r0 : r0 + r].reshape(r, nb, 1)).mul_(256)
        idx = index[: r * half].view(r, nb, MXFP4_BLOCK // 2)
        idx.copy_(blocks[r0 : r0 + r].reshape(r, nb, MXFP4_BLOCK // 2)).add_(s)
        w = torch.index_select(table, 0, index[: r * half], out=pairs[: r * half]).view(work).view(r, -1)
        if work != x.dtype:
            w = w.to(x.dtype)
        if out is None:
            return F.linear(x, w)
        out[..., r0 : r0 + r] = F.linear(x, w)
    assert out is not None
    return out
