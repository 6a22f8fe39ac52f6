"""An expert's stored tensors as the engine's `ExpertWeights`: canonical projection names, the
forms kept compact under `expert_quant` (int8, MXFP4) and the bytes they take.

Shared by the lazily read FTW store (`loading.ftw_provider`) and the tiered expert memory
(`memory`), so neither imports the other. Blocks hold the canonical projections (`experts.py`):
``gate_up [2I, H]`` (or ``gate`` and ``up`` ``[I, H]`` stored separately, as pre-quantized
DeepSeek-V3 fp8 imports keep them), ``down [H, I]``, optional ``gate_up_bias [2I]`` and
``down_bias [H]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..errors import FTWFormatError
from ..ftw.codecs import MXFP4_BLOCK, EncodedTensor, decode
from ..ftw.layout import TensorInfo
from ..kernels.int8 import ExpertQuant, quantize
from .experts import ExpertKey

WEIGHT_NAMES = ("gate_up", "gate", "up", "down")
"""The weight projections an expert block may store (the rest are biases and scales)."""
_KNOWN = {*WEIGHT_NAMES, "gate_up_bias", "down_bias"} | {f"{n}_scale" for n in WEIGHT_NAMES}


def canonical_expert(
    tensors: dict[str, torch.Tensor], *, path: str = "", key: ExpertKey | None = None
) -> dict[str, torch.Tensor]:
    """Decoded block projections -> the canonical ``ExpertWeights`` names (joins split gate/up).

    Int8 projections come with their row scales under ``<name>_scale``; split ``gate_scale`` and
    ``up_scale`` are joined like the weights. Raises FTWFormatError (naming ``path`` and ``key``)
    for unknown or missing projections, or a split gate/up of which only one half is int8.
    """
    where = f"{path}: expert block (layer={key[0]}, expert={key[1]})" if key else path or "expert block"
    unknown = set(tensors) - _KNOWN
    if unknown:
        raise FTWFormatError(f"{where}: unknown projections {sorted(unknown)}")
    out = dict(tensors)
    if "gate" in out or "up" in out:
        if "gate_up" in out or "gate" not in out or "up" not in out:
            raise FTWFormatError(f"{where}: needs either 'gate_up' or both 'gate' and 'up'")
        if ("gate_scale" in out) != ("up_scale" in out):
            raise FTWFormatError(f"{where}: 'gate' and 'up' must both be int8 (with scales) or neither")
        out["gate_up"] = torch.cat([out.pop("gate"), out.pop("up")], dim=0)
        if "gate_scale" in out:
            out["gate_up_scale"] = torch.cat([out.pop("gate_scale"), out.pop("up_scale")], dim=0)
    for name in ("gate_up", "down"):
        if name not in out:
            raise FTWFormatError(f"{where}: missing projection {name!r}")
    return out


def kept_forms(codecs: Mapping[str, str], expert_quant: ExpertQuant) -> dict[str, str]:
    """The weight projections of a block (projection name -> stored codec) held compact under
    `expert_quant` (`int8.EXPERT_QUANTS`), each with its form: "int8" (stored int8, or any codec
    under "int8") or "mxfp4" (stored MXFP4 under "compact"). A split gate/up is joined: both in
    one form or neither."""
    keep: dict[str, str] = {}
    if expert_quant == "none":
        return keep
    for name, codec in codecs.items():
        if name not in WEIGHT_NAMES:
            continue
        if codec == "int8" or expert_quant == "int8":
            keep[name] = "int8"
        elif codec == "mxfp4" and expert_quant == "compact":
            keep[name] = "mxfp4"
    if keep.get("gate") != keep.get("up"):
        keep.pop("gate", None)
        keep.pop("up", None)
    return keep


def expert_tensors(
    encs: Mapping[str, EncodedTensor],
    dtype: torch.dtype,
    expert_quant: ExpertQuant,
    *,
    path: str = "",
    key: ExpertKey | None = None,
) -> dict[str, torch.Tensor]:
    """A block's encoded projections -> canonical `ExpertWeights` tensors: the projections
    `kept_forms` picks stay compact: int8 (weight + fp32 row scale: the stored parts themselves,
    zero-copy, when stored as int8; quantized otherwise) or MXFP4 (blocks [N, K/2] + E8M0 scales
    [N, K/32], the stored parts); every other one is decoded to `dtype` (views of the stored parts
    when the codec is `dtype` itself). Raises FTWFormatError as `canonical_expert`."""
    keep = kept_forms({n: e.codec for n, e in encs.items()}, expert_quant)
    tensors: dict[str, torch.Tensor] = {}
    for name, enc in encs.items():
        form = keep.get(name)
        if form is None:
            tensors[name] = decode(enc, dtype)
        elif form == "mxfp4":
            blocks = enc.parts["blocks"]
            tensors[name] = blocks.view(blocks.shape[0], -1)
            tensors[f"{name}_scale"] = enc.parts["scales"]
        elif enc.codec == "int8":  # as stored: no requantization
            tensors[name], tensors[f"{name}_scale"] = enc.parts["weight"], enc.parts["scale"]
        else:
            tensors[name], tensors[f"{name}_scale"] = quantize(decode(enc, torch.float32))
    return canonical_expert(tensors, path=path, key=key)


def kept_bytes(tensors: Mapping[str, TensorInfo], expert_quant: ExpertQuant, dtype: torch.dtype) -> int:
    """Bytes of one expert block (its manifest `tensors`) held as `expert_tensors` holds it: int8
    weights with their fp32 row scales, MXFP4 blocks with their E8M0 scales, the other projections
    in `dtype`."""
    keep = kept_forms({n: t.codec for n, t in tensors.items()}, expert_quant)
    elem = dtype.itemsize
    total = 0
    for name, t in tensors.items():
        n = math.prod(t.shape)
        form = keep.get(name)
        if form == "int8":
            total += n + 4 * t.shape[0]
        elif form == "mxfp4":
            total += n // 2 + n // MXFP4_BLOCK
        else:
            total += n * elem
    return total
