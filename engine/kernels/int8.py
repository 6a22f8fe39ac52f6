"""Int8 weight-only linear layers: int8 weights with one fp32 scale per output row, no float copy.

The layout is FTW's ``int8`` codec (`ftw.codecs.int8_channel.Int8Codec`): ``weight int8 [out, in]`` in
[-127, 127] and ``scale float32 [out]``, ``W = weight * scale[:, None]``.

How a product is computed (`int8_linear`), measured on a 2-core AVX2 CPU with torch 2.13:

- few tokens (T <= `KERNEL_MAX_TOKENS`, i.e. decode) on CPU: ``torch._weight_int8pack_mm``, a fused
  int8-weight GEMV that reads each int8 weight once and never writes a float copy. It takes bf16
  activations (its fp32 and fp16 variants are scalar loops on AVX2, ~25x slower), so activations
  are cast to bf16 on the way in; the scale is applied in fp32 on the way out (the kernel gets
  unit scales), so the only roundings beyond the int8 weights are bf16 activations and a bf16
  output of the kernel (relative 2^-9 each).
- few tokens on CUDA: `gemv_triton.int8_gemv`, a Triton GEMV reading each int8 weight once and
  accumulating in fp32, the scale applied per row at the end (self-checked once per device
  against the dequantize path; a failure is logged and dequantize serves).
- many tokens (prefill), other devices, or shapes the kernel cannot take: dequantize
  ``weight * scale`` in fp32 into a reused per-thread scratch block of at most `DEQUANT_BLOCK`
  elements, row block by row block, and ``F.linear`` each block (float GEMM). Per block this
  equals the codec's decode followed by ``F.linear``.

Kernel contract (read from aten/src/ATen/native/cpu/int8mm_kernel.cpp and checked here): the
weight must be a contiguous int8 [N, K] CPU tensor; activations [M, K] bf16, scales [N] bf16. The
vectorised loops step over K in 8 (AVX2) or 16 (AVX-512) values with no tail and use aligned loads
of the activation rows, so K not a multiple of 16 gives wrong values or a crash: `kernel_fits`
refuses those shapes and they take the dequantize path. N and M are free.

Letters: T tokens, K input features, N output features.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal, cast, get_args

import torch
import torch.nn.functional as F
from torch import nn

from ..choices import EXPERT_QUANTS, ExpertQuant
from ..errors import EngineError
from . import gemv_triton
from .scratch import thread_buffer

logger = logging.getLogger(__name__)

KERNEL_MAX_TOKENS = 8
"""Largest T computed with the fused kernel. Measured for a [2048, 1024] weight on one core (noisy,
shared machine): kernel 0.38 / 0.60 / 1.56 / 2.36 ms at T = 1 / 4 / 8 / 16, dequantize + fp32 GEMM
1.2 / 1.5 / 2.8 / 2.6 ms: the kernel wins up to T ~ 8-16."""
KERNEL_K_MULTIPLE = 16
"""The kernel's input features must be a multiple of this (AVX-512 steps of 16; AVX2 needs 8)."""
DEQUANT_BLOCK = 1 << 21
"""Elements of weight dequantized at once on the prefill path (8 MiB fp32: stays in L3)."""

DenseQuantPart = Literal["attention", "lm_head"]
DENSE_QUANTS: tuple[DenseQuantPart, ...] = get_args(DenseQuantPart)
"""`Engine.from_pretrained(dense_quant=...)` parts: attention projections (q/k/v/o, MLA's
q/q_a/q_b/kv_a/o; not MLA's kv_b, whose weight is used directly) and the output head."""


def check_expert_quant(value: object, error: type[Exception] = EngineError) -> ExpertQuant:
    """`value` as an `ExpertQuant`, or `error` (EngineError; `EngineOptions` passes ValueError)
    naming it and the accepted values. Checked where a value enters: `EngineOptions`, and the
    public entry points built without options (`load_ftw`, `TieredExpertProvider`); the layers
    below take the typed value as given."""
    if value not in EXPERT_QUANTS:
        raise error(f"unknown expert_quant {value!r}; expected one of {', '.join(EXPERT_QUANTS)}")
    return cast(ExpertQuant, value)


def check_dense_quant(
    parts: Iterable[str] | None, error: type[Exception] = EngineError
) -> tuple[DenseQuantPart, ...]:
    """`parts` as sorted, distinct `DenseQuantPart` names, or `error` naming the bad ones (or a
    string given for the sequence). Checked once, by `EngineOptions`."""
    if isinstance(parts, str):
        raise error(f"dense_quant must be a sequence of part names, got the string {parts!r}")
    names = tuple(sorted(set(parts or ())))
    unknown = [p for p in names if p not in DENSE_QUANTS]
    if unknown:
        raise error(f"unknown dense_quant parts {unknown}; expected a subset of {list(DENSE_QUANTS)}")
    return cast(tuple[DenseQuantPart, ...], names)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``weight [N, K]`` -> (int8 [N, K], fp32 scale [N]) with FTW's int8 codec (same bits)."""
    from ..ftw.codecs import encode

    enc = encode(weight, "int8")
    return enc.parts["weight"].to(weight.device), enc.parts["scale"].to(weight.device)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [N, K] int8 * scale [N]`` -> [N, K] of ``dtype`` (computed in fp32, as the codec does)."""
    w = q.to(torch.float32).mul_(scale.to(torch.float32)[:, None])
    return w if dtype == torch.float32 else w.to(dtype)


_KERNEL_OK: bool | None = None
_UNIT_SCALES: dict[int, torch.Tensor] = {}


def kernel_available() -> bool:
    """Whether ``torch._weight_int8pack_mm`` exists here and gives right values (checked once)."""
    global _KERNEL_OK
    if _KERNEL_OK is None:
        _KERNEL_OK = _self_check()
    return _KERNEL_OK


def _self_check() -> bool:
    op = getattr(torch, "_weight_int8pack_mm", None)
    if op is None:
        logger.info("torch %s has no _weight_int8pack_mm; int8 uses dequantize + F.linear", torch.__version__)
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2 * KERNEL_K_MULTIPLE, generator=g).to(torch.bfloat16)
    q = torch.randint(-127, 128, (5, 2 * KERNEL_K_MULTIPLE), generator=g, dtype=torch.int8)
    try:
        got = op(x, q, torch.ones(5, dtype=torch.bfloat16)).float()
    except (RuntimeError, NotImplementedError) as e:
        logger.warning("torch._weight_int8pack_mm fails here (%s); using dequantize + F.linear", e)
        return False
    want = x.float() @ q.float().T
    ok = bool(((got - want).abs() <= 1e-2 * want.abs().max()).all())
    if not ok:
        logger.warning("torch._weight_int8pack_mm gives wrong values here; using dequantize + F.linear")
    return ok


def gpu_kernel_ok(device: torch.device) -> bool:
    """Whether the Triton int8 GEMV (`gemv_triton.int8_gemv`) serves decode on `device`: checked
    once per device against the dequantize path (a failure is logged; dequantize is used)."""
    return gemv_triton.usable("int8", device, _gpu_self_check)


def _gpu_self_check(device: torch.device) -> bool:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 200, generator=g)
    q, scale = quantize(w)
    q, scale = q.to(device), scale.to(device)
    x = torch.randn(3, 200, generator=g).to(device)
    want = dequant_linear(x, q, scale)
    got = gemv_triton.int8_gemv(x, q, scale)
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())))


def kernel_fits(q: torch.Tensor) -> bool:
    """Whether the fused kernel may take weight ``q`` (see the module doc for the contract)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.int8
        and q.dim() == 2
        and q.shape[1] % KERNEL_K_MULTIPLE == 0
        and q.is_contiguous()
        and kernel_available()
    )


def _unit_scales(n: int) -> torch.Tensor:
    ones = _UNIT_SCALES.get(n)
    if ones is None:
        with torch.inference_mode(False):  # a normal tensor: usable inside and outside inference mode
            ones = _UNIT_SCALES.setdefault(n, torch.ones(n, dtype=torch.bfloat16))
    return ones


def kernel_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ (q * scale).T`` with the fused kernel -> [T, N] fp32. Caller checks `kernel_fits`."""
    xb = x.to(torch.bfloat16)
    if not xb.is_contiguous() or xb.data_ptr() % 64:  # the kernel loads activation rows aligned
        xb = xb.clone(memory_format=torch.contiguous_format)
    y = torch._weight_int8pack_mm(xb, q, _unit_scales(q.shape[0]))  # [T, N] bf16, sum of x * q
    return torch.mul(y, scale)  # bf16 * fp32 -> fp32


def dequant_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, dequantize(q, scale), bias)`` one row block at a time (no full float copy).

    x [T, K] -> [T, N] of x.dtype. A weight of at most `DEQUANT_BLOCK` elements is one block, so
    the result is exactly ``F.linear`` on the codec's decoded weight.
    """
    n, k = q.shape
    rows = max(1, min(n, DEQUANT_BLOCK // max(k, 1)))
    buf = thread_buffer("int8 dequant", rows * k, torch.float32, q.device)
    out = None if rows == n else torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        w = buf[: (r1 - r0) * k].view(r1 - r0, k).copy_(q[r0:r1]).mul_(scale[r0:r1, None])
        if x.dtype != torch.float32:
            w = w.to(x.dtype)
        b = None if bias is None else bias[r0:r1]
        if out is None:
            return F.linear(x, w, b)
        out[..., r0:r1] = F.linear(x, w, b)
    assert out is not None
    return out


def int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """``x [T, K] @ (q * scale[:, None]).T + bias`` -> [T, N] of x.dtype.

    ``use_kernel=None`` picks the fused kernel for T <= `KERNEL_MAX_TOKENS` when `kernel_fits`,
    else dequantizes; True/False force a path (True still falls back when the kernel cannot take
    the shape).
    """
    if use_kernel is None:
        use_kernel = x.shape[0] <= KERNEL_MAX_TOKENS
    if use_kernel and x.dim() == 2 and q.device.type == "cuda" and gpu_kernel_ok(q.device):
        y = gemv_triton.int8_gemv(x, q, scale)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)
    if not (use_kernel and x.dim() == 2 and kernel_fits(q)):
        return dequant_linear(x, q, scale, bias)
    y = kernel_linear(x, q, scale)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


class Int8Linear(nn.Module):
    """A bias-optional linear layer held as int8 weight + fp32 per-row scale (see `int8_linear`)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight_int8", q.contiguous())  # [N, K] int8
        self.register_buffer("scale", scale.to(torch.float32).contiguous())  # [N]
        self.register_buffer("bias", bias)  # [N] or None
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Quantize a float ``weight [N, K]`` (FTW int8 codec); the float weight is not kept."""
        q, scale = quantize(weight)
        return cls(q, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight_int8, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"


_ATTENTION_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
)


def quantize_dense(model: nn.Module, parts: Iterable[DenseQuantPart]) -> list[str]:
    """Replace the float linear layers of ``parts`` (`DENSE_QUANTS`) in a loaded `MoETransformer`
    by `Int8Linear` layers, freeing their float weights. Returns the replaced module names.

    ``lm_head`` on a model with tied embeddings adds an int8 copy of the embedding as the head
    (the float embedding stays for the lookup). ``parts`` are taken as given (`EngineOptions`
    checks them: `check_dense_quant`).
    """
    parts = tuple(parts)
    replaced: list[str] = []
    if "attention" in parts:
        for i, layer in enumerate(model.layers):  # type: ignore[attr-defined]
            attn = layer.self_attn
            for name in _ATTENTION_PROJECTIONS:
                lin = getattr(attn, name, None)
                if isinstance(lin, nn.Linear):
                    setattr(attn, name, Int8Linear.from_weight(lin.weight, lin.bias))
                    replaced.append(f"layers.{i}.self_attn.{name}")
    if "lm_head" in parts:
        head = getattr(model, "lm_head", None)
        if isinstance(head, nn.Linear):
            model.lm_head = Int8Linear.from_weight(head.weight, head.bias)
        elif head is None:
            model.lm_head = Int8Linear.from_weight(model.embed_tokens.weight)  # type: ignore[attr-defined]
        replaced.append("lm_head")
    return replaced
