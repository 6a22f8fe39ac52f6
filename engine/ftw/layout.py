"""On-disk layout of an FTW file: constants, binary headers, dtype table and manifest records.

File layout (all integers little-endian)::

    offset 0      fixed header (`HEADER_STRUCT`, 48 bytes), zero-padded to ALIGNMENT (4096)
    4096 ...      data region, in the order the writer added them:
                    dense tensor   raw bytes, start aligned to DENSE_ALIGN (64)
                    expert block   start aligned to ALIGNMENT (4096):
                                   block header (`BLOCK_STRUCT`, 37 bytes) zero-padded to
                                   BLOCK_HEADER_SIZE (64), then the stored bytes
    manifest      UTF-8 JSON, written LAST (after all data) so the writer can stream; its offset,
                  length and xxhash64 are in the fixed header, which the writer rewrites on close.

Fixed header fields: magic ``b"FTW1"``, major u16, minor u16, flags u32 (0), alignment u32 (4096),
manifest_offset u64, manifest_length u64, manifest xxhash64 u64, then the xxhash64 (seed 0) of the
40 preceding header bytes. The fixed header occupies the first ``alignment`` bytes (so ``alignment``
is also the header length); the data region starts there.

Expert block header fields: magic ``b"FTWX"``, layer u32, expert u32, stored_length u64,
raw_length u64, xxhash64 u64 of the stored bytes, compression u8 (0 none, 1 zstd). The raw bytes of
a block are its parts' bytes concatenated in manifest order, each part starting at a multiple of
PART_ALIGN (64) inside the raw bytes (``offset_in_block`` is relative to the start of the raw,
i.e. decompressed, bytes); "zstd" stores the raw bytes as one zstd frame.

Manifest checksums (``xxhash64`` of dense tensors and expert blocks) are 16-digit lower-case hex
strings, so that JSON readers without 64-bit integers can handle them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch

FORMAT_MAJOR = 1
FORMAT_MINOR = 0
MAGIC = b"FTW1"
BLOCK_MAGIC = b"FTWX"
ALIGNMENT = 4096
DENSE_ALIGN = 64
PART_ALIGN = 64
BLOCK_HEADER_SIZE = 64

HEADER_STRUCT = struct.Struct("<4sHHIIQQQ")  # everything the header checksum covers
HEADER_HASH_STRUCT = struct.Struct("<Q")
HEADER_SIZE = HEADER_STRUCT.size + HEADER_HASH_STRUCT.size
BLOCK_STRUCT = struct.Struct("<4sIIQQQB")

COMPRESSIONS = ("none", "zstd")
COMPRESSION_IDS = {"none": 0, "zstd": 1}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
"""Manifest dtype name -> torch dtype (the dtypes a dense tensor or a part may have)."""
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def align_up(n: int, a: int) -> int:
    """Smallest multiple of ``a`` that is >= ``n``."""
    return (n + a - 1) // a * a


def hex64(h: int) -> str:
    """Format a 64-bit checksum as the manifest stores it."""
    return f"{h:016x}"


@dataclass(frozen=True)
class DenseInfo:
    """Manifest record of one dense tensor; ``offset`` and ``nbytes`` in bytes from file start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    xxhash64: str


@dataclass(frozen=True)
class PartInfo:
    """One stored part of an encoded projection; ``offset_in_block`` is relative to the raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    offset_in_block: int
    nbytes: int


@dataclass(frozen=True)
class TensorInfo:
    """One projection of an expert: its codec, logical shape and parts (in layout order)."""

    codec: str
    shape: tuple[int, ...]
    parts: dict[str, PartInfo]


@dataclass(frozen=True)
class ExpertInfo:
    """Manifest record of one expert block.

    ``offset`` is the file offset of the block header (a multiple of 4096); the stored bytes start
    at ``offset + BLOCK_HEADER_SIZE`` and span ``stored_length`` bytes; they decompress to
    ``raw_length`` bytes. ``xxhash64`` (hex) covers the stored bytes.
    """

    layer: int
    expert: int
    offset: int
    stored_length: int
    raw_length: int
    compression: str
    xxhash64: str
    tensors: dict[str, TensorInfo]

    @property
    def data_offset(self) -> int:
        """File offset of the first stored byte."""
        return self.offset + BLOCK_HEADER_SIZE

    @property
    def block_length(self) -> int:
        """Bytes of the whole block on disk (header + stored bytes, no trailing padding)."""
        return BLOCK_HEADER_SIZE + self.stored_length


MAX_ELEMENTS = 2**48
"""Bound on the product of a shape's dims (zero dims counted as 1): torch computes sizes and strides
in int64, so a zero-sized tensor with dims past that bound would make it raise, not hold no data."""
_U32_MAX = 2**32 - 1


def _shape(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(s, int) and s >= 0 for s in v):
        raise ValueError(f"bad shape {v!r}")
    extent = 1
    for s in v:
        extent *= max(s, 1)
    if extent > MAX_ELEMENTS:
        raise ValueError(f"shape {v!r} is too large")
    return tuple(v)


def _nonneg(v: Any, what: str, limit: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (limit is not None and v > limit):
        raise ValueError(f"bad {what} {v!r}")
    return v


def _hexstr(v: Any) -> str:
    if not isinstance(v, str) or len(v) != 16 or any(c not in "0123456789abcdef" for c in v):
        raise ValueError(f"bad xxhash64 {v!r}")
    return v


def _dtype(v: Any) -> str:
    if v not in DTYPES:
        raise ValueError(f"unknown dtype {v!r}")
    return v


def parse_dense(name: str, rec: dict[str, Any]) -> DenseInfo:
    """Build a `DenseInfo` from its manifest JSON; ValueError/KeyError/TypeError on bad records."""
    info = DenseInfo(
        name=name,
        dtype=_dtype(rec["dtype"]),
        shape=_shape(rec["shape"]),
        offset=_nonneg(rec["offset"], "offset"),
        nbytes=_nonneg(rec["nbytes"], "nbytes"),
        xxhash64=_hexstr(rec["xxhash64"]),
    )
    numel = 1
    for s in info.shape:
        numel *= s
    if numel * DTYPES[info.dtype].itemsize != info.nbytes:
        raise ValueError(f"nbytes {info.nbytes} does not match {info.dtype} {list(info.shape)}")
    return info


def parse_expert(rec: dict[str, Any]) -> ExpertInfo:
    """Build an `ExpertInfo` from its manifest JSON; ValueError/KeyError/TypeError on bad records."""
    if rec["compression"] not in COMPRESSIONS:
        raise ValueError(f"unknown compression {rec['compression']!r}")
    raw_length = _nonneg(rec["raw_length"], "raw_length")
    tensors: dict[str, TensorInfo] = {}
    for pname, t in rec["tensors"].items():
        parts: dict[str, PartInfo] = {}
        for part_name, p in t["parts"].items():
            part = PartInfo(
                dtype=_dtype(p["dtype"]),
                shape=_shape(p["shape"]),
                offset_in_block=_nonneg(p["offset_in_block"], "offset_in_block"),
                nbytes=_nonneg(p["nbytes"], "nbytes"),
            )
            numel = 1
            for s in part.shape:
                numel *= s
            if numel * DTYPES[part.dtype].itemsize != part.nbytes:
                raise ValueError(f"part {pname}.{part_name}: nbytes does not match dtype and shape")
            if part.offset_in_block + part.nbytes > raw_length:
                raise ValueError(f"part {pname}.{part_name} ends past raw_length {raw_length}")
            parts[part_name] = part
        if not isinstance(t["codec"], str):
            raise ValueError(f"bad codec {t['codec']!r}")
        tensors[pname] = TensorInfo(codec=t["codec"], shape=_shape(t["shape"]), parts=parts)
    info = ExpertInfo(
        layer=_nonneg(rec["layer"], "layer", _U32_MAX),  # the block header stores them as u32
        expert=_nonneg(rec["expert"], "expert", _U32_MAX),
        offset=_nonneg(rec["offset"], "offset"),
        stored_length=_nonneg(rec["stored_length"], "stored_length"),
        raw_length=raw_length,
        compression=rec["compression"],
        xxhash64=_hexstr(rec["xxhash64"]),
        tensors=tensors,
    )
    if info.offset % ALIGNMENT:
        raise ValueError(f"block offset {info.offset} is not a multiple of {ALIGNMENT}")
    if info.compression == "none" and info.stored_length != info.raw_length:
        raise ValueError("uncompressed block with stored_length != raw_length")
    return info
