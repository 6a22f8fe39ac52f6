"""Weight codecs of the FTW format: one codec per quantization scheme, one module per family.

A codec turns a float tensor into an `EncodedTensor` (codec name, logical shape and a dict of named
torch tensors: payload and scales) and back. Codecs never produce bytes; the container
(`container.py`) lays the parts out on disk. Every decode is vectorised (lookup tables and block
broadcasts, no Python loops over elements) and computes in float32 before a final cast, except where
the result is provably identical in the target dtype.

Schemes (`CODECS`), each module's docstring giving its parts and its arithmetic:

- `plain`: ``"fp32"``, ``"bf16"``: the tensor as-is, any rank.
- `fp8_block`: ``"fp8_e4m3"``, DeepSeek-V3's float8 with one scale per 128x128 block.
- `int8_channel`: ``"int8"``, symmetric int8 with one scale per output channel.
- `mxfp4`: ``"mxfp4"``, OCP Microscaling FP4 in gpt-oss's on-disk layout.
- `gguf_blocks`: ``"int8_b32"``, ``"uint4_b32"``, GGUF's 32-value blocks (Q8_0, Q4_0/Q4_1/Q4_K).

`base` holds `EncodedTensor` and the `Codec` interface; `registry` the codecs by name.
"""

from __future__ import annotations

from .base import Codec, EncodedTensor
from .fp8_block import FP8_BLOCK, wrap_fp8_block
from .gguf_blocks import QBLOCK
from .mxfp4 import MXFP4_BLOCK, MXFP4_VALUES, wrap_mxfp4
from .registry import CODECS, decode, encode, get_codec

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
