"""The codecs of GGUF's 32-value blocks, which hold a GGUF file's quantized experts with the values
llama.cpp computes, bit for bit (`loading/gguf/quants.py` converts the blocks):

- ``"int8_b32"``: symmetric int8 with one fp16 scale per 32 input values (GGUF's Q8_0 exactly), 2-D,
  input dim a multiple of 32. ``weight`` int8 ``[out, in]`` and ``scale`` float16 ``[out, in/32]``;
  dequant ``weight * scale`` in float32 (exact: 8-bit times 11-bit significands). Encode sets
  ``scale = fp16(amax(block) / 127)`` (1.0 for an all-zero block) and rounds ``x / scale``.
- ``"uint4_b32"``: affine 4-bit, one float32 scale and min per 32 input values, 2-D, input dim a
  multiple of 32. ``blocks`` uint8 ``[out, in/32, 16]`` (codes 0..15, two per byte, LOW nibble = even
  index, as ``"mxfp4"``), ``scales`` and ``mins`` float32 ``[out, in/32]``; dequant
  ``code * scale + min`` in float32. Holds GGUF's Q4_0 (``scale = d``, ``min = -8 d``), Q4_1
  (``scale = d``, ``min = m``) and Q4_K (``scale = d * sc``, ``min = -(dmin * m)``, products of an fp16
  and a 6-bit integer, exact in float32). Encode takes each block's min and
  ``scale = (max - min) / 15`` and rounds ``(x - min) / scale``.
"""

from __future__ import annotations

import torch

from .base import Codec, EncodedTensor, Shape, check_2d, check_float_input, check_out_dtype

QBLOCK = 32
"""Number of consecutive input-dim values that share one scale in ``"int8_b32"`` and ``"uint4_b32"``."""


def _finite_blocks(tensor: torch.Tensor, codec: str) -> tuple[torch.Tensor, int, int]:
    """A 2-D float input as float32 blocks ``[out, in/32, 32]``, with ``out`` and ``in``
    (ValueError: not float, not 2-D, ``in`` not a multiple of 32, NaN or inf values)."""
    t = check_float_input(tensor, codec)
    out, inp = _check_blocked(tuple(t.shape), codec)
    x = t.to(torch.float32).reshape(out, inp // QBLOCK, QBLOCK)
    if not torch.isfinite(x).all():
        raise ValueError(f"codec {codec!r}: input has NaN or inf values")
    return x, out, inp


def _check_blocked(shape: Shape, codec: str) -> tuple[int, int]:
    out, inp = check_2d(shape, codec)
    if inp % QBLOCK:
        raise ValueError(
            f"codec {codec!r} needs the input dim to be a multiple of {QBLOCK}, got shape {list(shape)}; "
            "store this tensor with another codec (e.g. 'bf16' or 'int8')"
        )
    return out, inp


class Int8Block32Codec(Codec):
    """Symmetric int8 with one fp16 scale per 32 input values (GGUF Q8_0's values, exactly)."""

    name = "int8_b32"

    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        out, inp = _check_blocked(shape, self.name)
        return {"weight": (torch.int8, (out, inp)), "scale": (torch.float16, (out, inp // QBLOCK))}

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        x, out, inp = _finite_blocks(tensor, self.name)
        amax = x.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.float16)
        scale = torch.where(scale > 0, scale, torch.full_like(scale, 2.0**-24))  # fp16 underflow
        q = torch.round(x / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
        return EncodedTensor(self.name, (out, inp), {"weight": q.reshape(out, inp), "scale": scale})

    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        check_out_dtype(dtype, self.name)
        out, inp = check_2d(enc.shape, self.name)
        x = enc.parts["weight"].to(torch.float32).view(out, inp // QBLOCK, QBLOCK)
        x.mul_(enc.parts["scale"].to(torch.float32)[..., None])
        x = x.view(out, inp)
        return x if dtype == torch.float32 else x.to(dtype)


def unpack_nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n]`` (LOW nibble = even index) -> uint8 codes ``[..., 2n]``."""
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., 2n]`` in 0..15 -> uint8 ``[..., n]`` (LOW nibble = even index)."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


class UInt4Block32Codec(Codec):
    """Affine 4-bit codes with one fp32 scale and min per 32 input values (GGUF Q4_0/Q4_1/Q4_K)."""

    name = "uint4_b32"

    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        out, inp = _check_blocked(shape, self.name)
        nb = inp // QBLOCK
        return {
            "blocks": (torch.uint8, (out, nb, QBLOCK // 2)),
            "scales": (torch.float32, (out, nb)),
            "mins": (torch.float32, (out, nb)),
        }

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        x, out, inp = _finite_blocks(tensor, self.name)
        lo, hi = x.amin(dim=-1), x.amax(dim=-1)
        scale = (hi - lo) / 15.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round((x - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
        return EncodedTensor(
            self.name,
            (out, inp),
            {"blocks": pack_nibbles(codes), "scales": scale.contiguous(), "mins": lo.contiguous()},
        )

    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        check_out_dtype(dtype, self.name)
        out, inp = check_2d(enc.shape, self.name)
        x = unpack_nibbles(enc.parts["blocks"]).to(torch.float32)  # [out, nb, 32]
        x.mul_(enc.parts["scales"].to(torch.float32)[..., None])
        x.add_(enc.parts["mins"].to(torch.float32)[..., None])
        x = x.view(out, inp)
        return x if dtype == torch.float32 else x.to(dtype)
