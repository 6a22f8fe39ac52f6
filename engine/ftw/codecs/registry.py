"""The codecs by name: `CODECS`, `get_codec`, and `encode` / `decode` through them. A new codec is
one module beside the others and one entry here."""

from __future__ import annotations

import torch

from .base import Codec, EncodedTensor
from .fp8_block import FP8E4M3Codec
from .gguf_blocks import Int8Block32Codec, UInt4Block32Codec
from .int8_channel import Int8Codec
from .mxfp4 import MXFP4Codec
from .plain import BF16Codec, FP32Codec

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
