"""RMSNorm as one Triton kernel, for CUDA decode steps.

`layers.RMSNorm` in PyTorch ops is ~7 kernels for a bf16 row (upcast, square, mean, add eps,
rsqrt, scale, downcast and the weight); a decode step runs two norms per layer, so in a captured
CUDA graph those launches are a large share of what a layer costs above its weight bytes (issue
31: the resident engine ran 264 us per layer above the HBM bound on an H200). `rms_norm` does
the same arithmetic in one kernel, a program per row: the sum of squares in fp32, the row scaled
by rsqrt(mean + eps) in fp32, then, as `RMSNorm.forward`, either rounded to the activation dtype
and multiplied by the weight in that dtype, or multiplied by an fp32 weight and rounded
(`weight_in_fp32`, gpt-oss). Only the order of the sum of squares differs from the PyTorch ops.
`add_rms_norm` also does the residual add before it (a decoder layer's `x + attention(...)`
and its post-attention norm: one kernel instead of two).

Arithmetic checked on CPU under Triton's interpreter (tests/test_norm_triton.py); on a device,
`usable` runs the self-check once and a kernel that fails or disagrees is logged once, and the
PyTorch ops serve.

Letters: T rows (tokens), H hidden size.
"""

from __future__ import annotations

import torch

from . import gemv_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: RMSNorm keeps its PyTorch ops
    triton = None


if triton is not None:

    @triton.jit
    def _bf16_grid(x):
        """fp32 -> fp32 on the bf16 grid, rounded to nearest even. Done on the bits: Triton's
        interpreter truncates a cast to bf16 (a GPU rounds to nearest), and a value already on
        the grid converts exactly either way, so tests under the interpreter see a GPU's bits."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        # Shifts, not a 0xFFFF0000 mask: a literal above 2**31 would make the bits int64.
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _rms_norm_kernel(
        X, R, Sum, W, Out, H, s_x, s_r, s_sum, s_o, eps,
        BLOCK: tl.constexpr, W_FP32: tl.constexpr, BF16: tl.constexpr, ADD: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(X + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:  # the residual add first: x + r rounded to the activation dtype, stored, normed
            x = x + tl.load(R + row * s_r + cols, mask=mask, other=0.0).to(tl.float32)
            if BF16:
                x = _bf16_grid(x)
            else:
                x = x.to(Sum.dtype.element_ty).to(tl.float32)
            tl.store(Sum + row * s_sum + cols, x.to(Sum.dtype.element_ty), mask=mask)
        h = x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if not W_FP32:  # h rounded to the activation dtype first, as RMSNorm does
            if BF16:
                h = _bf16_grid(h)
            else:
                h = h.to(Out.dtype.element_ty).to(tl.float32)
        # The product of two bf16 values is exact in fp32: rounding it once on the store equals
        # the product in bf16.
        y = w * h
        if BF16:
            y = _bf16_grid(y)
        tl.store(Out + row * s_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """x [..., H] -> RMSNorm(x) [..., H] in x.dtype (module doc). `weight` [H]: in x.dtype, or fp32
    with `weight_in_fp32`. On CPU only under Triton's interpreter."""
    return _launch(x, None, weight, eps, weight_in_fp32)[1]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) for s = x + residual in x.dtype, in one kernel (a decoder layer's residual
    add and the norm after it)."""
    s, h = _launch(x, residual, weight, eps, weight_in_fp32)
    assert s is not None
    return s, h


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, weight_in_fp32: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).contiguous()
    res = rows if residual is None else residual.reshape(-1, shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    total = out if residual is None else torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    h = shape[-1]
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res, total, weight, out, h, rows.stride(0), res.stride(0), total.stride(0), out.stride(0), eps,
        BLOCK=block, W_FP32=weight_in_fp32, BF16=x.dtype == torch.bfloat16, ADD=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return (None if residual is None else total.view(shape)), out.view(shape)


def kernel_ok(device: torch.device) -> bool:
    """Whether the fused kernel serves RMSNorm on `device` (a GPU where it runs and agrees with the
    PyTorch ops; checked once per device)."""
    return device.type == "cuda" and gemv_triton.usable("rms_norm", device, _self_check)


def _self_check(device: torch.device) -> bool:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 2880, generator=g) * 4).to(device=device, dtype=torch.bfloat16)
    w = (torch.rand(2880, generator=g) + 0.5).to(device)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    ok = True
    for in_fp32, want in ((True, (w * h).to(x.dtype)), (False, w.to(x.dtype) * h.to(x.dtype))):
        got = rms_norm(x, w if in_fp32 else w.to(x.dtype), 1e-5, in_fp32)
        ok = ok and bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
    return ok
