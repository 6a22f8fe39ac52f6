"""FTW (FreeToken Weights): the engine's weight file format.

- `codecs`: per-scheme quantization codecs (fp32, bf16, fp8_e4m3 block-scaled, int8 per-channel,
  mxfp4) producing `EncodedTensor` objects, plus wrappers for already-quantized gpt-oss MXFP4 and
  DeepSeek-V3 fp8 weights.
- `container`: `FTWWriter` / `FTWFile`, one file per model with a JSON manifest, dense tensors
  (read into memory of their own) and 4 KiB-aligned, checksummed, optionally zstd-compressed expert blocks.
"""

from __future__ import annotations

from .codecs import (
    CODECS,
    Codec,
    EncodedTensor,
    decode,
    encode,
    get_codec,
    wrap_fp8_block,
    wrap_mxfp4,
)
from .container import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    DenseInfo,
    ExpertInfo,
    FTWFile,
    FTWWriter,
    PartInfo,
    TensorInfo,
)

__all__ = [
    "CODECS",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "Codec",
    "DenseInfo",
    "EncodedTensor",
    "ExpertInfo",
    "FTWFile",
    "FTWWriter",
    "PartInfo",
    "TensorInfo",
    "decode",
    "encode",
    "get_codec",
    "wrap_fp8_block",
    "wrap_mxfp4",
]
