"""MXFP4 weight-only linear layers: products computed from the stored 4-bit form, never decoded
into a resident float copy (`expert_quant="compact"`).

The layout is FTW's ``mxfp4`` codec (`ftw.codecs.MXFP4Codec`, gpt-oss's on-disk form) with the
block axis flattened: ``blocks uint8 [N, K/2]`` (two E2M1 codes a byte, the even input feature in
the low nibble) and ``scales uint8 [N, K/32]`` (E8M0: 2**(s - 127) for each run of 32 inputs).
An expert held this way takes ~0.53 bytes a weight: 3.8x fewer than bf16, 7.5x fewer than fp32.

How a product is computed (`mxfp4_linear`):
- CUDA, few tokens (T <= `KERNEL_MAX_TOKENS`, i.e. decode), Triton installed: `_gemv_kernel`, a
  GEMV that reads each stored byte once, decodes both nibbles and the block's scale in registers
  and accumulates in fp32, so a decode step moves the stored bytes instead of decoded ones. The
  first use on a device checks it against the codec's decode (`kernel_ok`); a kernel that fails
  or disagrees is logged once and the decode path serves instead.
- otherwise (prefill, CPU, no Triton): decode the weight with the codec into the activation dtype,
  transiently, and ``F.linear`` (the same values as decoding at load: bit-equal to it).

The kernel's arithmetic is checked on CPU by Triton's interpreter (tests/test_mxfp4.py); the
launch on a GPU by `-m cuda` tests.

Letters: T tokens, K input features, N output features.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: products decode the weight first
    triton = None

from .ftw.codecs import MXFP4_BLOCK, EncodedTensor, get_codec

logger = logging.getLogger(__name__)

KERNEL_MAX_TOKENS = 8
"""Largest T computed by the GEMV kernel; more tokens (prefill) decode and run a float GEMM."""
BLOCK_N = 32
"""Output rows per kernel program."""
BLOCK_BYTES = 64
"""Stored bytes of a row read per step (128 input features: four scale blocks)."""

_KERNEL_OK: dict[torch.device, bool] = {}


def decode_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [N, K/2], scales [N, K/32] -> the float weight [N, K] in `dtype` (the codec's decode)."""
    n, half = blocks.shape
    nb = scales.shape[1]
    enc = EncodedTensor(
        "mxfp4", (n, 2 * half), {"blocks": blocks.view(n, nb, MXFP4_BLOCK // 2), "scales": scales}
    )
    return get_codec("mxfp4").decode(enc, dtype)


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        X, Blocks, Scales, Out, N, HALF_K,
        s_xt, s_bn, s_sn, s_ot,
        BLOCK_N: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        t = tl.program_id(1)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_BYTES)  # byte j of a step holds inputs 2j (low) and 2j + 1 (high)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for b0 in range(0, HALF_K, BLOCK_BYTES):
            byte_idx = b0 + cols
            mask = (rows[:, None] < N) & (byte_idx[None, :] < HALF_K)
            byte = tl.load(Blocks + rows[:, None] * s_bn + byte_idx[None, :], mask=mask, other=0).to(tl.int32)
            scale_code = tl.load(
                Scales + rows[:, None] * s_sn + byte_idx[None, :] // 16, mask=mask, other=127
            )
            scale = tl.exp2(scale_code.to(tl.float32) - 127.0)
            lo = byte & 15
            hi = byte >> 4
            # E2M1 code c = sign << 3 | e << 1 | m: |value| = m / 2 if e == 0 else (1 + m / 2) * 2**(e - 1)
            lo_e = (lo >> 1) & 3
            hi_e = (hi >> 1) & 3
            lo_m = (lo & 1).to(tl.float32)
            hi_m = (hi & 1).to(tl.float32)
            lo_v = tl.where(lo_e == 0, 0.5 * lo_m, (1.0 + 0.5 * lo_m) * tl.exp2((lo_e - 1).to(tl.float32)))
            hi_v = tl.where(hi_e == 0, 0.5 * hi_m, (1.0 + 0.5 * hi_m) * tl.exp2((hi_e - 1).to(tl.float32)))
            lo_v = tl.where((lo & 8) != 0, -lo_v, lo_v) * scale
            hi_v = tl.where((hi & 8) != 0, -hi_v, hi_v) * scale
            xmask = byte_idx < HALF_K
            x_even = tl.load(X + t * s_xt + 2 * byte_idx, mask=xmask, other=0.0).to(tl.float32)
            x_odd = tl.load(X + t * s_xt + 2 * byte_idx + 1, mask=xmask, other=0.0).to(tl.float32)
            acc += tl.sum(lo_v * x_even[None, :] + hi_v * x_odd[None, :], axis=1)
        tl.store(Out + t * s_ot + rows, acc, mask=rows < N)


def kernel_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ W.T`` by the GEMV kernel -> [T, N] fp32 (x, blocks, scales on one device; on
    CPU only under Triton's interpreter)."""
    x = x.contiguous()
    blocks, scales = blocks.contiguous(), scales.contiguous()
    t, n, half = x.shape[0], blocks.shape[0], blocks.shape[1]
    out = torch.empty(t, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, BLOCK_N), t)
    _gemv_kernel[grid](
        x, blocks, scales, out, n, half,
        x.stride(0), blocks.stride(0), scales.stride(0), out.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_BYTES=BLOCK_BYTES,
    )  # fmt: skip
    return out


def kernel_ok(device: torch.device) -> bool:
    """Whether the GEMV kernel runs on `device` and agrees with the codec's decode (checked once
    per device; a failure is logged and the decode path is used)."""
    if device.type != "cuda":
        return False
    if device not in _KERNEL_OK:
        _KERNEL_OK[device] = _self_check(device)
    return _KERNEL_OK[device]


def _self_check(device: torch.device) -> bool:
    if triton is None:
        logger.info("triton is not installed: MXFP4 products decode the weight first")
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 160, generator=g)
    enc = get_codec("mxfp4").encode(w)
    blocks, scales = enc.parts["blocks"].reshape(48, 80).to(device), enc.parts["scales"].to(device)
    x = torch.randn(3, 160, generator=g).to(device)
    want = F.linear(x, decode_weight(blocks, scales, torch.float32))
    try:
        got = kernel_linear(x, blocks, scales)
        ok = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())))
    except Exception as e:  # noqa: BLE001 - any failure of a kernel this repository never ran here
        logger.warning(
            "the MXFP4 GEMV kernel fails on %s (%s); MXFP4 products decode the weight first", device, e
        )
        return False
    if not ok:
        logger.warning("the MXFP4 GEMV kernel disagrees with the decode on %s; using the decode", device)
    return ok


def mxfp4_linear(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [T, K] @ W.T + bias`` for W [N, K] held as MXFP4 (`blocks [N, K/2]`, `scales [N, K/32]`)
    -> [T, N] in x.dtype (module doc: kernel for decode on CUDA, else decode + float GEMM)."""
    if x.dim() == 2 and x.shape[0] <= KERNEL_MAX_TOKENS and kernel_ok(x.device):
        y = kernel_linear(x, blocks, scales)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)
    y = F.linear(x, decode_weight(blocks, scales, x.dtype))
    return y if bias is None else y + bias
