"""Weight codecs of the FTW format: one codec per quantization scheme.

A codec turns a float tensor into an `EncodedTensor` (codec name, logical shape and a dict of named
torch tensors: payload and scales) and back. Codecs never produce bytes; the container
(`container.py`) lays the parts out on disk. Every decode is vectorised (lookup tables and block
broadcasts, no Python loops over elements) and computes in float32 before a final cast, except where
the result is provably identical in the target dtype.

Schemes (`CODECS`):

- ``"fp32"``: ``weight`` float32, any rank. Exact.
- ``"bf16"``: ``weight`` bfloat16, any rank. Exact for inputs already representable in bf16.
- ``"fp8_e4m3"``: DeepSeek-V3 block scaling, 2-D ``[out, in]`` only. ``weight`` float8_e4m3fn
  ``[out, in]`` and ``scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``; dequant is
  ``weight.float() * scale_inv`` broadcast over each 128x128 block (edge blocks may be partial).
  Encode sets ``scale_inv = amax(block) / 448`` (1.0 for an all-zero block).
- ``"int8"``: symmetric per output channel, 2-D only. ``weight`` int8 ``[out, in]`` in [-127, 127]
  and ``scale`` float32 ``[out]``; dequant ``weight * scale[:, None]``. Encode sets
  ``scale = amax(row) / 127`` (1.0 for an all-zero row).
- ``"mxfp4"``: OCP Microscaling FP4, 2-D only, gpt-oss's on-disk layout. ``blocks`` uint8
  ``[out, in/32, 16]`` (32 E2M1 codes per block, two per byte, LOW nibble = even index) and
  ``scales`` uint8 ``[out, in/32]`` (E8M0: value ``2**(s - 127)``, 255 = NaN). The input dim must be a
  multiple of 32: other sizes raise `ValueError` (no silent padding, so shapes on disk always equal
  logical shapes). Encode picks per block the smallest ``e`` (clamped to [-127, 127]) with
  ``amax <= 6 * 2**e``, then rounds each ``x / 2**e`` to the nearest E2M1 value, ties to the even code.
- ``"int8_b32"``: symmetric int8 with one fp16 scale per 32 input values (GGUF's Q8_0 exactly), 2-D,
  input dim a multiple of 32. ``weight`` int8 ``[out, in]`` and ``scale`` float16 ``[out, in/32]``;
  dequant ``weight * scale`` in float32 (exact: 8-bit times 11-bit significands). Encode sets
  ``scale = fp16(amax(block) / 127)`` (1.0 for an all-zero block) and rounds ``x / scale``.
- ``"uint4_b32"``: affine 4-bit, one float32 scale and min per 32 input values, 2-D, input dim a
  multiple of 32. ``blocks`` uint8 ``[out, in/32, 16]`` (codes 0..15, two per byte, LOW nibble = even
  index, as ``"mxfp4"``), ``scales`` and ``mins`` float32 ``[out, in/32]``; dequant
  ``code * scale + min`` in float32. Holds GGUF's Q4_0 (``scale = d``, ``min = -8 d``), Q4_1
  (``scale = d``, ``min = m``) and Q4_K (``scale = d * sc``, ``min = -(dmin * m)``, products of an fp16
  and a 6-bit integer, exact in float32) with the values llama.cpp computes, bit for bit. Encode takes
  each block's min and ``scale = (max - min) / 15`` and rounds ``(x - min) / scale``.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CODECS",
    "Codec",
    "EncodedTensor",
    "FP8_BLOCK",
    "MXFP4_BLOCK",
    "MXFP4_VALUES",
    "QBLOCK",
    "decode",
    "encode",
    "get_codec",
    "wrap_fp8_block",
    "wrap_mxfp4",
]

FP8_BLOCK = 128
"""Side of the square weight block that shares one fp8 ``scale_inv`` (DeepSeek-V3)."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
MXFP4_BLOCK = 32
"""Number of consecutive input-dim values that share one E8M0 scale."""
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1 code (0..15) -> value."""
QBLOCK = 32
"""Number of consecutive input-dim values that share one scale in ``"int8_b32"`` and ``"uint4_b32"``."""
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

Shape = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class EncodedTensor:
    """A tensor in one codec's representation.

    Attributes:
        codec: codec name, one of `CODECS`.
        shape: logical (decoded) shape.
        parts: named stored tensors (payload and scales), contiguous CPU tensors whose names, dtypes
            and shapes are fixed by the codec (`Codec.part_specs`).
    """

    codec: str
    shape: Shape
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def nbytes(self) -> int:
        """Total bytes of all parts (the size of this tensor in the container, before padding)."""
        return sum(p.numel() * p.element_size() for p in self.parts.values())


def _check_float_input(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"codec {codec!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not (tensor.is_floating_point()):
        raise ValueError(f"codec {codec!r}: expected a floating-point tensor, got {tensor.dtype}")
    return tensor.detach().cpu()


def _check_2d(shape: Shape, codec: str) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(
            f"codec {codec!r} needs a 2-D [out, in] weight, got shape {list(shape)} "
            f"(store 1-D tensors such as biases with 'fp32' or 'bf16')"
        )
    return shape[0], shape[1]


def _check_out_dtype(dtype: torch.dtype, codec: str) -> None:
    if not dtype.is_floating_point:
        raise ValueError(f"codec {codec!r}: decode dtype must be floating point, got {dtype}")


class Codec(ABC):
    """One quantization scheme. Subclasses are stateless singletons obtained with `get_codec`."""

    name: str = ""

    @abstractmethod
    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        """Return ``{part_name: (dtype, shape)}`` of the parts that encode a tensor of ``shape``.

        Raises ValueError when the codec cannot represent that shape.
        """

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        """Quantize a floating-point CPU tensor (any float dtype) into this codec's parts."""

    @abstractmethod
    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize ``enc`` to a tensor of ``enc.shape`` and ``dtype``.

        The result may share memory with ``enc.parts`` when no conversion is needed (fp32/bf16
        codecs decoded to their own dtype); treat it as read-only or clone it.
        """

    def validate(self, enc: EncodedTensor) -> None:
        """Raise ValueError unless ``enc`` has exactly this codec's parts (names, dtypes, shapes)."""
        if enc.codec != self.name:
            raise ValueError(f"EncodedTensor has codec {enc.codec!r}, expected {self.name!r}")
        specs = self.part_specs(enc.shape)
        if set(enc.parts) != set(specs):
            raise ValueError(
                f"codec {self.name!r}: parts {sorted(enc.parts)} do not match expected {sorted(specs)}"
            )
        for pname, (dt, shp) in specs.items():
            p = enc.parts[pname]
            if p.dtype != dt or tuple(p.shape) != shp:
                raise ValueError(
                    f"codec {self.name!r}, part {pname!r}: got {p.dtype} {list(p.shape)}, "
                    f"expected {dt} {list(shp)} for logical shape {list(enc.shape)}"
                )


class _PlainCodec(Codec):
    """Store the tensor as-is in one float dtype (any rank)."""

    store_dtype: torch.dtype = torch.float32

    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        return {"weight": (self.store_dtype, tuple(shape))}

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        t = _check_float_input(tensor, self.name)
        w = t.to(self.store_dtype).contiguous()
        return EncodedTensor(self.name, tuple(t.shape), {"weight": w})

    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        _check_out_dtype(dtype, self.name)
        return enc.parts["weight"].to(dtype)


class FP32Codec(_PlainCodec):
    name = "fp32"
    store_dtype = torch.float32


class BF16Codec(_PlainCodec):
    name = "bf16"
    store_dtype = torch.bfloat16


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
        out, inp = _check_2d(shape, self.name)
        return {
            "weight": (torch.float8_e4m3fn, (out, inp)),
            "scale_inv": (torch.float32, _fp8_scale_shape(out, inp)),
        }

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        t = _check_float_input(tensor, self.name)
        out, inp = _check_2d(tuple(t.shape), self.name)
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
        _check_out_dtype(dtype, self.name)
        _check_2d(enc.shape, self.name)
        x = enc.parts["weight"].to(torch.float32)
        _apply_block_scale(x, enc.parts["scale_inv"].to(torch.float32), FP8_BLOCK, divide=False)
        return x if dtype == torch.float32 else x.to(dtype)


class Int8Codec(Codec):
    """Symmetric int8 with one fp32 scale per output channel (row)."""

    name = "int8"

    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        out, inp = _check_2d(shape, self.name)
        return {"weight": (torch.int8, (out, inp)), "scale": (torch.float32, (out,))}

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        t = _check_float_input(tensor, self.name)
        out, inp = _check_2d(tuple(t.shape), self.name)
        x = t.to(torch.float32)
        if not torch.isfinite(x).all():
            raise ValueError(f"codec {self.name!r}: input has NaN or inf values")
        amax = x.abs().amax(dim=1) if inp else torch.zeros(out)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).contiguous()
        q = torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        return EncodedTensor(self.name, (out, inp), {"weight": q, "scale": scale})

    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        _check_out_dtype(dtype, self.name)
        _check_2d(enc.shape, self.name)
        x = enc.parts["weight"].to(torch.float32)
        x.mul_(enc.parts["scale"].to(torch.float32)[:, None])
        return x if dtype == torch.float32 else x.to(dtype)


def _mxfp4_pair_lut(dtype: torch.dtype) -> torch.Tensor:
    """[256, 2] table: byte -> (value of low nibble, value of high nibble)."""
    vals = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([vals[codes & 0x0F], vals[codes >> 4]], dim=1).to(dtype)


def _e8m0_lut(dtype: torch.dtype) -> torch.Tensor:
    """[256] table: E8M0 byte -> 2**(s - 127); 255 -> NaN."""
    lut = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127)
    lut[255] = float("nan")
    return lut.to(dtype)


_LUTS: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _luts(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode tables where the blocks are (a GPU decodes stored bytes it received in place)."""
    key = (dtype, device)
    if key not in _LUTS:
        _LUTS[key] = (_mxfp4_pair_lut(dtype).to(device), _e8m0_lut(dtype).to(device))
    return _LUTS[key]


_SCALED_PAIRS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_PAIR_AS_INT = {torch.float32: torch.int64, torch.bfloat16: torch.int32}


def mxfp4_scaled_pairs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The MXFP4 decode as one table, for decoding with a single gather: entry ``s * 256 + b``
    holds byte b's two values (low nibble first) times E8M0 scale s, computed as
    `MXFP4Codec.decode` computes them (the same products, so the same bits), each pair viewed
    as one integer so a gather moves both values at once -> [65536] int64 (`dtype` float32) or
    int32 (bfloat16; the only dtypes the codec computes in directly)."""
    if dtype not in _PAIR_AS_INT:
        raise ValueError(f"mxfp4_scaled_pairs computes in float32 or bfloat16, not {dtype}")
    key = (dtype, device)
    table = _SCALED_PAIRS.get(key)
    if table is None:
        pairs, scales = _luts(dtype, device)
        table = (pairs.view(1, 256, 2) * scales.view(256, 1, 1)).contiguous()  # [s, b, 2]
        table = _SCALED_PAIRS.setdefault(key, table.view(_PAIR_AS_INT[dtype]).view(-1))
    return table


class MXFP4Codec(Codec):
    """OCP MX FP4 (E2M1 elements, E8M0 scale per 32 input values), gpt-oss's on-disk layout."""

    name = "mxfp4"

    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        out, inp = _check_2d(shape, self.name)
        if inp % MXFP4_BLOCK:
            raise ValueError(
                f"codec 'mxfp4' needs the input dim to be a multiple of {MXFP4_BLOCK}, got shape "
                f"{list(shape)}; store this tensor with another codec (e.g. 'bf16' or 'fp8_e4m3')"
            )
        nb = inp // MXFP4_BLOCK
        return {"blocks": (torch.uint8, (out, nb, MXFP4_BLOCK // 2)), "scales": (torch.uint8, (out, nb))}

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        t = _check_float_input(tensor, self.name)
        out, inp = _check_2d(tuple(t.shape), self.name)
        self.part_specs((out, inp))  # raises on a bad input dim
        nb = inp // MXFP4_BLOCK
        x = t.to(torch.float32).reshape(out, nb, MXFP4_BLOCK)
        if not torch.isfinite(x).all():
            raise ValueError("codec 'mxfp4': input has NaN or inf values")
        amax = x.abs().amax(dim=-1)
        # Smallest integer e with amax <= 6 * 2**e: estimate with log2, then fix rounding exactly.
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        e = torch.ceil(torch.log2(safe / 6.0)).to(torch.int32)
        e = torch.where(amax > torch.ldexp(torch.full_like(amax, 6.0), e), e + 1, e)
        e = torch.where(amax <= torch.ldexp(torch.full_like(amax, 6.0), e - 1), e - 1, e)
        e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp_(-127, 127)
        a = torch.ldexp(x.abs(), (-e)[..., None])
        bounds = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32)
        code = torch.bucketize(a, bounds, right=False)  # a == midpoint k|k+1 gives the lower code k
        # A tie at midpoint k|k+1 goes to the even code: move the odd lower codes up by one.
        tie = a == torch.cat([bounds, bounds.new_full((1,), math.inf)])[code]
        code = code.add_(tie & (code % 2 == 1)).to(torch.uint8)
        code |= torch.signbit(x).to(torch.uint8) << 3
        code = code.reshape(out, nb, MXFP4_BLOCK // 2, 2)
        blocks = (code[..., 0] | (code[..., 1] << 4)).contiguous()
        scales = (e + 127).to(torch.uint8).contiguous()
        return EncodedTensor(self.name, (out, inp), {"blocks": blocks, "scales": scales})

    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        _check_out_dtype(dtype, self.name)
        out, inp = _check_2d(enc.shape, self.name)
        blocks, scales = enc.parts["blocks"], enc.parts["scales"]
        # E2M1 values times powers of two are exact in fp32 and bf16 (same exponent range), so
        # those dtypes compute directly; others (fp16 range) compute in fp32 and cast.
        work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        pair_lut, scale_lut = _luts(work, blocks.device)
        nb = blocks.shape[1]
        vals = torch.index_select(pair_lut, 0, blocks.reshape(-1).to(torch.int32))
        vals = vals.view(out, nb, MXFP4_BLOCK)
        vals.mul_(torch.index_select(scale_lut, 0, scales.reshape(-1).to(torch.int32)).view(out, nb, 1))
        x = vals.view(out, inp)
        return x if work == dtype else x.to(dtype)


def _finite_blocks(tensor: torch.Tensor, codec: str) -> tuple[torch.Tensor, int, int]:
    """A 2-D float input as float32 blocks ``[out, in/32, 32]``, with ``out`` and ``in``
    (ValueError: not float, not 2-D, ``in`` not a multiple of 32, NaN or inf values)."""
    t = _check_float_input(tensor, codec)
    out, inp = _check_blocked(tuple(t.shape), codec)
    x = t.to(torch.float32).reshape(out, inp // QBLOCK, QBLOCK)
    if not torch.isfinite(x).all():
        raise ValueError(f"codec {codec!r}: input has NaN or inf values")
    return x, out, inp


def _check_blocked(shape: Shape, codec: str) -> tuple[int, int]:
    out, inp = _check_2d(shape, codec)
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
        _check_out_dtype(dtype, self.name)
        out, inp = _check_2d(enc.shape, self.name)
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
        _check_out_dtype(dtype, self.name)
        out, inp = _check_2d(enc.shape, self.name)
        x = unpack_nibbles(enc.parts["blocks"]).to(torch.float32)  # [out, nb, 32]
        x.mul_(enc.parts["scales"].to(torch.float32)[..., None])
        x.add_(enc.parts["mins"].to(torch.float32)[..., None])
        x = x.view(out, inp)
        return x if dtype == torch.float32 else x.to(dtype)


_REGISTRY: dict[str, Codec] = {
    c.name: c
    for c in (
        FP32Codec(),
        BF16Codec(),
        FP8E4M3Codec(),
        Int8Codec(),
        MXFP4Codec(),
        Int8Block32Codec(),
        UInt4Block32Codec(),
    )
}
CODECS: tuple[str, ...] = tuple(_REGISTRY)
"""Names of all known codecs."""


def get_codec(name: str) -> Codec:
    """Return the codec called ``name``; raise ValueError listing `CODECS` for an unknown name."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {name!r}; known codecs: {', '.join(CODECS)}") from None


def encode(tensor: torch.Tensor, codec: str) -> EncodedTensor:
    """Encode ``tensor`` with the codec named ``codec``."""
    return get_codec(codec).encode(tensor)


def decode(enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode ``enc`` with its own codec to ``dtype`` (see `Codec.decode`)."""
    return get_codec(enc.codec).decode(enc, dtype)


def wrap_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> EncodedTensor:
    """Wrap one expert's already-quantized gpt-oss MXFP4 weight without re-quantizing.

    Args:
        blocks: uint8 ``[out, in/32, 16]`` (one expert's slice of a ``*_blocks`` tensor).
        scales: uint8 or float8_e8m0fnu ``[out, in/32]`` (the matching ``*_scales`` slice).

    Returns an ``"mxfp4"`` EncodedTensor of logical shape ``[out, in]``; contiguous CPU inputs are
    used without a copy (the parts share their memory). Raises ValueError on bad dtypes or shapes.
    """
    if scales.dtype == torch.float8_e8m0fnu:
        scales = scales.view(torch.uint8)
    if blocks.dim() != 3 or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"mxfp4 blocks must be [out, in/32, 16], got {list(blocks.shape)}")
    out, nb, _ = blocks.shape
    enc = EncodedTensor(
        "mxfp4",
        (out, nb * MXFP4_BLOCK),
        {"blocks": blocks.detach().cpu().contiguous(), "scales": scales.detach().cpu().contiguous()},
    )
    _REGISTRY["mxfp4"].validate(enc)
    return enc


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
    _REGISTRY["fp8_e4m3"].validate(enc)
    return enc
