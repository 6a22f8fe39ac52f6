"""Triton GEMVs over compact weights, for decode steps on a GPU: MXFP4 (`mxfp4.py`) and int8 with
per-row scales (`int8.py`).

A decode step multiplies a few token vectors by each weight once, so its time is the weight bytes
read. These kernels read the stored bytes (0.53 bytes a weight for MXFP4, 1 for int8) and decode
them in registers, accumulating in fp32, instead of materialising a float copy of the weight
(what the decode / dequantize paths do: write and read 4 bytes a weight). Grid: (output row
blocks of `BLOCK_N`, routes); each program walks the inputs `BLOCK_K` at a time.

A route is one product of an input row by one weight: a token, for one weight (`int8_gemv`,
`mxfp4_gemv`), or a (token, expert) pair of a routed batch over stacked experts
(`int8_grouped_gemv`, `mxfp4_grouped_gemv`: weights [S, N, K] of S slots; route r multiplies
input row r // x_div by the weight of slot `slots[r]`, read on the device). The grouped form
lets a layer's routed int8 or MXFP4 experts run with no host sync (a CUDA graph), from a
resident stack or tier 1's slot pool (`grouped_experts.run_grouped`).

Never run on a GPU in this repository's CI (no GPU there): the arithmetic is checked on CPU by
Triton's interpreter (TRITON_INTERPRET=1, tests/test_gemv_triton.py). On a device, `usable` runs a
caller's self-check once per device and kernel; a kernel that raises or disagrees is logged once
and its caller keeps its decode path.

Letters: T tokens, K input features, N output features.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers use their decode paths
    triton = None

logger = logging.getLogger(__name__)

BLOCK_N = 32
"""Output rows per program."""
BLOCK_K = 128
"""Input features per step (MXFP4: 64 stored bytes, four scale blocks)."""

_USABLE: dict[tuple[str, torch.device], bool] = {}


if triton is not None:

    @triton.jit
    def _mxfp4_kernel(
        X, Blocks, Scales, Slots, Out, N, HALF_K, X_DIV,
        s_xt, s_bslot, s_bn, s_sslot, s_sn, s_ot,
        BLOCK_N: tl.constexpr, BLOCK_BYTES: tl.constexpr, GROUPED: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        r = tl.program_id(1)
        if GROUPED:  # this route's weight: its slot of the stack (int64: a pool can pass 2 GiB)
            slot = tl.load(Slots + r).to(tl.int64)
            Blocks += slot * s_bslot
            Scales += slot * s_sslot
        t = r // X_DIV
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_BYTES)  # byte j of a step holds inputs 2j (low) and 2j + 1 (high)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for b0 in range(0, HALF_K, BLOCK_BYTES):
            idx = b0 + cols
            mask = (rows[:, None] < N) & (idx[None, :] < HALF_K)
            byte = tl.load(Blocks + rows[:, None] * s_bn + idx[None, :], mask=mask, other=0).to(tl.int32)
            code = tl.load(Scales + rows[:, None] * s_sn + idx[None, :] // 16, mask=mask, other=127)
            scale = tl.exp2(code.to(tl.float32) - 127.0)
            lo = byte & 15
            hi = byte >> 4
            # E2M1 code = sign << 3 | e << 1 | m: |value| = m / 2 if e == 0 else (1 + m / 2) * 2**(e - 1)
            lo_e = (lo >> 1) & 3
            hi_e = (hi >> 1) & 3
            lo_m = (lo & 1).to(tl.float32)
            hi_m = (hi & 1).to(tl.float32)
            lo_v = tl.where(lo_e == 0, 0.5 * lo_m, (1.0 + 0.5 * lo_m) * tl.exp2((lo_e - 1).to(tl.float32)))
            hi_v = tl.where(hi_e == 0, 0.5 * hi_m, (1.0 + 0.5 * hi_m) * tl.exp2((hi_e - 1).to(tl.float32)))
            lo_v = tl.where((lo & 8) != 0, -lo_v, lo_v) * scale
            hi_v = tl.where((hi & 8) != 0, -hi_v, hi_v) * scale
            xmask = idx < HALF_K
            x_even = tl.load(X + t * s_xt + 2 * idx, mask=xmask, other=0.0).to(tl.float32)
            x_odd = tl.load(X + t * s_xt + 2 * idx + 1, mask=xmask, other=0.0).to(tl.float32)
            acc += tl.sum(lo_v * x_even[None, :] + hi_v * x_odd[None, :], axis=1)
        tl.store(Out + r * s_ot + rows, acc, mask=rows < N)

    @triton.jit
    def _int8_kernel(
        X, Q, Scale, Slots, Out, N, K, X_DIV,
        s_xt, s_qslot, s_qn, s_sslot, s_ot,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPED: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        r = tl.program_id(1)
        if GROUPED:
            slot = tl.load(Slots + r).to(tl.int64)
            Q += slot * s_qslot
            Scale += slot * s_sslot
        t = r // X_DIV
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            idx = k0 + cols
            mask = (rows[:, None] < N) & (idx[None, :] < K)
            q = tl.load(Q + rows[:, None] * s_qn + idx[None, :], mask=mask, other=0).to(tl.float32)
            x = tl.load(X + t * s_xt + idx, mask=idx < K, other=0.0).to(tl.float32)
            acc += tl.sum(q * x[None, :], axis=1)
        scale = tl.load(Scale + rows, mask=rows < N, other=0.0)
        tl.store(Out + r * s_ot + rows, acc * scale, mask=rows < N)


def mxfp4_gemv(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ W.T`` for W held as MXFP4 (blocks [N, K/2] uint8, E8M0 scales [N, K/32]) ->
    [T, N] fp32. All on one device (on CPU only under Triton's interpreter)."""
    return _mxfp4(x, blocks.contiguous()[None], scales.contiguous()[None], None, 1)


def mxfp4_grouped_gemv(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, x_div: int = 1
) -> torch.Tensor:
    """Route r of `slots [R]` (int64, on the device): ``x[r // x_div] @ W[slots[r]].T`` for stacked
    MXFP4 weights (blocks [S, N, K/2], scales [S, N, K/32]; each row contiguous, rows and slots
    at any stride) -> [R, N] fp32."""
    return _mxfp4(x, blocks, scales, slots, x_div)


def _mxfp4(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor | None, x_div: int
) -> torch.Tensor:
    strides = (blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1))
    return _launch(_mxfp4_kernel, x, blocks, scales, slots, x_div, strides, BLOCK_BYTES=BLOCK_K // 2)


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ (q * scale[:, None]).T`` for q int8 [N, K], scale fp32 [N] -> [T, N] fp32."""
    return _int8(x, q.contiguous()[None], scale.contiguous()[None], None, 1)


def int8_grouped_gemv(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, x_div: int = 1
) -> torch.Tensor:
    """Route r of `slots [R]` (int64, on the device): ``x[r // x_div] @ (q * scale)[slots[r]].T``
    for stacked int8 weights (q [S, N, K], scale fp32 [S, N]; each row contiguous) -> [R, N]
    fp32."""
    return _int8(x, q, scale, slots, x_div)


def _int8(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor | None, x_div: int
) -> torch.Tensor:
    strides = (q.stride(0), q.stride(1), scale.stride(0))
    return _launch(_int8_kernel, x, q, scale, slots, x_div, strides, BLOCK_K=BLOCK_K)


def _launch(
    kernel: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    slots: torch.Tensor | None,
    x_div: int,
    strides: tuple[int, ...],
    **meta: int,
) -> torch.Tensor:
    """Run `kernel` over weights [S, N, K'] (K' the stored row: K int8 bytes, K/2 MXFP4 bytes):
    a program per `BLOCK_N` output rows and route -> [routes, N] fp32. `strides`: the weight's
    (slot, row) and the scale's (slot[, row]) strides."""
    x = x.contiguous()
    _check_rows(weight, scale)
    n, k = weight.shape[1], weight.shape[2]
    routes = x.shape[0] if slots is None else slots.shape[0]
    out = torch.empty(routes, n, dtype=torch.float32, device=x.device)
    kernel[(triton.cdiv(n, BLOCK_N), routes)](
        x, weight, scale, weight if slots is None else slots, out, n, k, x_div,
        x.stride(0), *strides, out.stride(0),
        BLOCK_N=BLOCK_N, GROUPED=slots is not None, **meta,
    )  # fmt: skip
    return out


def _check_rows(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """The kernels step along a weight row and a scale row one element at a time."""
    if weight.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("GEMV weights and scales must be contiguous along their last dimension")


def usable(name: str, device: torch.device, check: Callable[[torch.device], bool]) -> bool:
    """Whether kernel `name` may serve on `device`: Triton is installed and `check(device)` (run
    once per device) passed. A raising or failing check is logged once; the caller then keeps
    its decode path."""
    key = (name, device)
    if key not in _USABLE:
        if triton is None:
            logger.info("triton is not installed: %s products use the decode path", name)
            _USABLE[key] = False
        else:
            try:
                _USABLE[key] = check(device)
            except Exception as e:  # noqa: BLE001 - any failure of a kernel this repository never ran here
                logger.warning("the %s GEMV kernel fails on %s (%s); using the decode path", name, device, e)
                _USABLE[key] = False
            else:
                if not _USABLE[key]:
                    logger.warning("the %s GEMV kernel disagrees on %s; using the decode path", name, device)
    return _USABLE[key]
