"""``"mxfp4"``: OCP Microscaling FP4, 2-D only, gpt-oss's on-disk layout. ``blocks`` uint8
``[out, in/32, 16]`` (32 E2M1 codes per block, two per byte, LOW nibble = even index) and
``scales`` uint8 ``[out, in/32]`` (E8M0: value ``2**(s - 127)``, 255 = NaN). The input dim must be a
multiple of 32: other sizes raise `ValueError` (no silent padding, so shapes on disk always equal
logical shapes). Encode picks per block the smallest ``e`` (clamped to [-127, 127]) with
``amax <= 6 * 2**e``, then rounds each ``x / 2**e`` to the nearest E2M1 value, ties to the even code.

Decoding is two table lookups per byte, with the tables kept where the blocks are (a GPU decodes
the bytes it received in place); `mxfp4_scaled_pairs` is the decode as one table for the kernels.
`wrap_mxfp4` takes a gpt-oss checkpoint's already-quantized weight as it is.
"""

from __future__ import annotations

import math

import torch

from .base import Codec, EncodedTensor, Shape, check_2d, check_float_input, check_out_dtype

MXFP4_BLOCK = 32
"""Number of consecutive input-dim values that share one E8M0 scale."""
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1 code (0..15) -> value."""
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


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
        out, inp = check_2d(shape, self.name)
        if inp % MXFP4_BLOCK:
            raise ValueError(
                f"codec 'mxfp4' needs the input dim to be a multiple of {MXFP4_BLOCK}, got shape "
                f"{list(shape)}; store this tensor with another codec (e.g. 'bf16' or 'fp8_e4m3')"
            )
        nb = inp // MXFP4_BLOCK
        return {"blocks": (torch.uint8, (out, nb, MXFP4_BLOCK // 2)), "scales": (torch.uint8, (out, nb))}

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        t = check_float_input(tensor, self.name)
        out, inp = check_2d(tuple(t.shape), self.name)
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
        check_out_dtype(dtype, self.name)
        out, inp = check_2d(enc.shape, self.name)
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
    MXFP4Codec().validate(enc)  # stateless: any instance checks alike
    return enc
