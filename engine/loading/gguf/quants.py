"""GGUF tensor blocks -> FTW codecs, keeping each weight's precision class and its exact values.

=========  ================  ==============================================================
GGUF type  FTW codec         how (per 32 input values unless said)
=========  ================  ==============================================================
Q8_0       ``int8_b32``      int8 codes as stored, the fp16 ``d`` as the block scale
Q4_0       ``uint4_b32``     codes as stored, ``scale = d``, ``min = -8 d``
Q4_1       ``uint4_b32``     codes as stored, ``scale = d``, ``min = m``
Q4_K       ``uint4_b32``     per 32-value sub-block ``scale = d * sc``, ``min = -(dmin * m)``
MXFP4      ``mxfp4``         E2M1 codes and E8M0 scales as stored, nibbles repacked
BF16       ``bf16``          the values
others     ``fp32``          dequantized by `gguf.quants.dequantize` (F32, F16, Q5_*, Q6_K...)
=========  ================  ==============================================================

Every conversion yields exactly the values `gguf.quants.dequantize` computes (the codecs' float32
decode multiplies and adds the same exact operands), which the tests check bit for bit. Nibble
order: GGUF puts value ``j`` of a 32-block in the LOW nibble of byte ``j`` and value ``j + 16`` in
the HIGH nibble; FTW puts even values low and odd values high, so codes are repacked. An MXFP4
block with scale byte 255 (a finite ``2**128`` in ggml, NaN in OCP's E8M0) goes to ``fp32``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...ftw.codecs import QBLOCK, EncodedTensor, encode
from ...ftw.codecs.gguf_blocks import pack_nibbles
from .reader import GGUFTensor, dequantize, raw_rows

#: GGUF type name -> the FTW codec its weights are kept in (anything else: fp32, or bf16 for BF16)
KEPT_CODECS = {
    "Q8_0": "int8_b32",
    "Q4_0": "uint4_b32",
    "Q4_1": "uint4_b32",
    "Q4_K": "uint4_b32",
    "MXFP4": "mxfp4",
    "BF16": "bf16",
}
_TYPE_SIZES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "MXFP4": 17}


def kept_codec(type_name: str) -> str:
    """The FTW codec a weight of GGUF type `type_name` is stored in (see the module doc)."""
    return KEPT_CODECS.get(type_name, "fp32")


def encoded_weight(t: GGUFTensor, where: Path, index: int | None = None) -> EncodedTensor:
    """`t` (or ``t[index]``, one expert of a stacked tensor), a 2-D ``[out, in]`` weight, in its kept
    codec with the exact values of gguf-py's dequantization (CheckpointError as `dequantize`)."""
    shape = t.shape if index is None else t.shape[1:]
    name = t.type_name
    if name in _TYPE_SIZES and len(shape) == 2:
        rows = raw_rows(t, where, index)
        out, inp = shape
        block = 256 if name == "Q4_K" else QBLOCK
        if rows.shape == (out, inp // block * _TYPE_SIZES[name]) and inp % block == 0:
            enc = _CONVERTERS[name](rows.reshape(out, inp // block, _TYPE_SIZES[name]), (out, inp))
            if enc is not None:
                return enc
    values = dequantize(t, where, index)
    return encode(values, "bf16" if values.dtype == torch.bfloat16 else "fp32")


def _ggml_codes(qs: np.ndarray) -> torch.Tensor:
    """GGUF 4-bit codes ``[..., 16]`` bytes -> uint8 codes ``[..., 32]`` in value order."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def _fp16(b: np.ndarray) -> torch.Tensor:
    """Little-endian fp16 bytes ``[..., 2]`` -> float32 ``[...]`` (exact)."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _q8_0(blocks: np.ndarray, shape: tuple[int, int]) -> EncodedTensor:
    out, inp = shape
    scale = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].copy())
    weight = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out, inp).copy())
    return EncodedTensor("int8_b32", shape, {"weight": weight, "scale": scale})


def _uint4(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, shape: tuple[int, int]
) -> EncodedTensor:
    """codes uint8 ``[out, in/32, 32]``, scales / mins float32 ``[out, in/32]``."""
    return EncodedTensor(
        "uint4_b32",
        shape,
        {"blocks": pack_nibbles(codes), "scales": scales.contiguous(), "mins": mins.contiguous()},
    )


def _q4_0(blocks: np.ndarray, shape: tuple[int, int]) -> EncodedTensor:
    d = _fp16(blocks[..., 0:2])
    return _uint4(_ggml_codes(blocks[..., 2:]), d, d * -8.0, shape)


def _q4_1(blocks: np.ndarray, shape: tuple[int, int]) -> EncodedTensor:
    return _uint4(_ggml_codes(blocks[..., 4:]), _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4]), shape)


def _q4_k(blocks: np.ndarray, shape: tuple[int, int]) -> EncodedTensor:
    """Q4_K super-blocks ``[out, in/256, 144]``: fp16 d, fp16 dmin, 12 bytes of packed 6-bit
    (scale, min) for 8 sub-blocks of 32, then 128 bytes of codes (64 values per 32 bytes: the
    first 32 in the low nibbles, the next 32 in the high nibbles)."""
    out, inp = shape
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [out, S]
    sc_bytes = torch.from_numpy(np.ascontiguousarray(blocks[..., 4:16])).to(torch.int32)  # [out, S, 12]
    lo, hi, mix = sc_bytes[..., 0:4], sc_bytes[..., 4:8], sc_bytes[..., 8:12]
    sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)  # [out, S, 8]
    mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1)
    qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 16:])).view(out, -1, 4, 32)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(out, inp // QBLOCK, QBLOCK)
    scales = (d[..., None] * sc.to(torch.float32)).reshape(out, -1)  # exact: fp16 x 6-bit int
    mins = -(dmin[..., None] * mn.to(torch.float32)).reshape(out, -1)
    return _uint4(codes, scales, mins, shape)


def _mxfp4(blocks: np.ndarray, shape: tuple[int, int]) -> EncodedTensor | None:
    out, inp = shape
    scales = torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))
    if bool((scales == 255).any()):
        return None  # ggml's finite 2**128 scale has no OCP E8M0 code: stored as fp32
    codes = _ggml_codes(blocks[..., 1:])  # [out, nb, 32], codes mean the same E2M1 values
    return EncodedTensor("mxfp4", shape, {"blocks": pack_nibbles(codes), "scales": scales.contiguous()})


_CONVERTERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "MXFP4": _mxfp4}
