"""``"fp8_e4m3"``: DeepSeek-V3 block scaling, 2-D ``[out, in]`` only. ``weight`` float8_e4m3fn
``[out, in]`` and ``scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``; dequant is
``weight.float() * scale_inv`` broadcast over each 128x128 block (edge blocks may be partial).
Encode sets ``scale_inv = amax(block) / 448`` (1.0 for an all-zero block). `wrap_fp8_block` takes
a checkpoint's already-quantized weight as it is.
"""

from __future__ import annotations

import math

import torch

from .base import Codec, EncodedTensor, Shape, check_2d, check_float_input, check_out_dtype

FP8_BLOCK = 128
"""Side of the square weight block that shares one fp8 ``scale_inv`` (DeepSeek-V3)."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""


def _fp8_scale_shape(out: int, inp: int) -> Shape:
    return (math.ceil(out / FP8_BLOCK), math.ceil(inp / FP8_BLOCK))


def _apply_block_scale(x: torch.Tensor, scale: torch.Tensor, block: int, divide: bool) -> None:
    """In place: multiply (or divide) each ``block x block`` tile of 2-D ``x`` by its entry of ``scale``.

    Vectorised over the full tiles; partial edge tiles (when a dim is not a multiple of ``block``)
    are handled as at most three extra strided regions.
    """
    out, inp = x.shape
    fo, fi = out // block, inp // block  # number of full tiles per dim
    row_ranges = [(0, fo * block, fo, block)]
    if out % block:
        row_ranges.append((fo * block, out, 1, out - fo * block))
    col_ranges = [(0, fi * block, fi, block)]
    if inp % block:
        col_ranges.append((fi * block, inp, 1, inp - fi * block))
    for r0, r1, nr, br in row_ranges:
        if nr == 0 or r1 == r0:
            continue
        sr0 = r0 // block
        for c0, c1, nc, bc in col_ranges:
            if nc == 0 or c1 == c0:
                continue
            sc0 = c0 // block
            view = x[r0:r1, c0:c1].unflatten(1, (nc, bc)).unflatten(0, (nr, br))
            s = scale[sr0 : sr0 + nr, sc0 : sc0 + nc][:, None, :, None]
            if divide:
                view.div_(s)
            else:
                view.mul_(s)


class FP8E4M3Codec(Codec):
    """DeepSeek-V3 style float8_e4m3fn with one fp32 ``scale_inv`` per 128x128 block."""

    name = "fp8_e4m3"

    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        out, inp = check_2d(shape, self.name)
        return {
            "weight": (torch.float8_e4m3fn, (out, inp)),
            "scale_inv": (torch.float32, _fp8_scale_shape(out, inp)),
        }

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        t = check_float_input(tensor, self.name)
        out, inp = check_2d(tuple(t.shape), self.name)
        x = t.to(torch.float32, copy=True).contiguous()
        if not torch.isfinite(x).all():
            raise ValueError(f"codec {self.name!r}: input has NaN or inf values")
        so, si = _fp8_scale_shape(out, inp)
        padded = torch.nn.functional.pad(x.abs(), (0, si * FP8_BLOCK - inp, 0, so * FP8_BLOCK - out))
        amax = padded.view(so, FP8_BLOCK, si, FP8_BLOCK).amax(dim=(1, 3))
        scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        _apply_block_scale(x, scale_inv, FP8_BLOCK, divide=True)
        w = x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return EncodedTensor(self.name, (out, inp), {"weight": w, "scale_inv": scale_inv.contiguous()})

    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        check_out_dtype(dtype, self.name)
        check_2d(enc.shape, self.name)
        x = enc.parts["weight"].to(torch.float32)
        _apply_block_scale(x, enc.parts["scale_inv"].to(torch.float32), FP8_BLOCK, divide=False)
        return x if dtype == torch.float32 else x.to(dtype)


def wrap_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor) -> EncodedTensor:
    """Wrap a DeepSeek-V3 fp8 weight and its ``weight_scale_inv`` without re-quantizing.

    Args:
        weight: float8_e4m3fn ``[out, in]``.
        scale_inv: fp32 ``[ceil(out/128), ceil(in/128)]`` (bf16/fp16 are widened to fp32 exactly).

    Raises ValueError on a wrong dtype or shape.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 weight must be float8_e4m3fn, got {weight.dtype}")
    if scale_inv.is_floating_point() and scale_inv.dtype in (torch.bfloat16, torch.float16):
        scale_inv = scale_inv.to(torch.float32)
    shape = tuple(weight.shape)
    enc = EncodedTensor(
        "fp8_e4m3",
        shape,
        {"weight": weight.detach().cpu().contiguous(), "scale_inv": scale_inv.detach().cpu().contiguous()},
    )
    FP8E4M3Codec().validate(enc)  # stateless: any instance checks alike
    return enc
