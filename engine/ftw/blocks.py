"""One expert block of an FTW file as read from disk: its checks against the manifest (header
fields, stored length, xxhash64), its decompression, and its projections as zero-copy views of
the raw bytes (layout in `layout.py`).

`FTWFile` (reader.py) and `memory.storage.BlockReader` (past the page cache) read the bytes; every
path goes through these same checks. A failed check raises the FTWFormatError the caller's `err`
builds, naming the file, the block and the byte offset.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
import xxhash
import zstandard

from ..errors import FTWFormatError
from .codecs import EncodedTensor, get_codec
from .layout import BLOCK_MAGIC, BLOCK_STRUCT, COMPRESSION_IDS, DTYPES, ExpertInfo, hex64

Buffer = bytes | bytearray | memoryview


class ErrorAt(Protocol):
    """Builds the reader's error for a message, where the file has the fault (`FTWFile._err`)."""

    def __call__(
        self, msg: str, *, offset: int | None = None, key: tuple[int, int] | None = None
    ) -> FTWFormatError: ...


def check_block(info: ExpertInfo, head: Buffer, stored: Buffer, err: ErrorAt) -> None:
    """Check one block as read from disk: its header (`head`, at least `BLOCK_STRUCT.size` bytes)
    against the manifest record `info`, its stored bytes against their length and xxhash64."""
    key = (info.layer, info.expert)
    magic, b_layer, b_expert, s_len, r_len, digest, comp = BLOCK_STRUCT.unpack_from(head)
    if magic != BLOCK_MAGIC:
        raise err(f"bad block magic {magic!r}, expected {BLOCK_MAGIC!r}", offset=info.offset, key=key)
    want = (
        info.layer,
        info.expert,
        info.stored_length,
        info.raw_length,
        int(info.xxhash64, 16),
        COMPRESSION_IDS[info.compression],
    )
    got = (b_layer, b_expert, s_len, r_len, digest, comp)
    if got != want:
        raise err(
            f"block header (layer, expert, stored_length, raw_length, xxhash64, compression) = {got} "
            f"disagrees with the manifest {want}",
            offset=info.offset,
            key=key,
        )
    check_stored(info, stored, err)


def check_stored(info: ExpertInfo, stored: Buffer, err: ErrorAt) -> None:
    """Check a block's stored bytes against the manifest's length and xxhash64."""
    key = (info.layer, info.expert)
    if len(stored) != info.stored_length:
        raise err(
            f"stored bytes have length {len(stored)}, expected {info.stored_length}",
            offset=info.data_offset,
            key=key,
        )
    h = hex64(xxhash.xxh64_intdigest(stored))
    if h != info.xxhash64:
        raise err(
            f"checksum mismatch over bytes [{info.data_offset}, "
            f"{info.data_offset + info.stored_length}): xxhash64 {h}, manifest says "
            f"{info.xxhash64} (corrupted block)",
            offset=info.data_offset,
            key=key,
        )


def raw_of(info: ExpertInfo, stored: Buffer, err: ErrorAt) -> Buffer:
    """A block's raw bytes: `stored` itself when the block is not compressed, else decompressed
    (to exactly the manifest's raw_length, checked before any memory is allocated)."""
    if info.compression == "none":
        return stored
    key = (info.layer, info.expert)
    try:
        # zstandard allocates the size the frame header declares: check it before decompressing.
        declared = zstandard.frame_content_size(stored)
        if declared not in (-1, info.raw_length):
            raise err(
                f"zstd frame declares {declared} bytes of content, the manifest's raw_length is "
                f"{info.raw_length}",
                offset=info.data_offset,
                key=key,
            )
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=info.raw_length)
    except zstandard.ZstdError as e:
        raise err(f"zstd decompression failed: {e}", offset=info.data_offset, key=key) from e
    except MemoryError as e:  # a raw_length no machine can hold
        raise err(
            f"cannot allocate {info.raw_length} bytes to decompress the block",
            offset=info.data_offset,
            key=key,
        ) from e
    if len(raw) != info.raw_length:
        raise err(
            f"decompressed to {len(raw)} bytes, expected {info.raw_length}",
            offset=info.data_offset,
            key=key,
        )
    return raw


def projections(info: ExpertInfo, raw: Buffer | torch.Tensor, err: ErrorAt) -> dict[str, EncodedTensor]:
    """A block's projections undecoded: each part a zero-copy view of `raw` (bytes, or a uint8
    tensor on any device), each projection checked against its codec's part specs."""
    key = (info.layer, info.expert)
    view = _tensor_view if isinstance(raw, torch.Tensor) else _view
    out: dict[str, EncodedTensor] = {}
    for pname, t in info.tensors.items():
        parts = {
            part_name: view(raw, DTYPES[p.dtype], p.shape, p.offset_in_block)
            for part_name, p in t.parts.items()
        }
        enc = EncodedTensor(t.codec, t.shape, parts)
        try:
            get_codec(t.codec).validate(enc)
        except ValueError as e:
            raise err(f"projection {pname!r}: {e}", offset=info.offset, key=key) from e
        out[pname] = enc
    return out


def _view(buf: Buffer, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """Zero-copy tensor over ``buf[offset:]`` (non-writable buffers give a tensor to treat as read-only)."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(buf, bytearray) or (isinstance(buf, memoryview) and not buf.readonly):
        # (catch_warnings costs more than the view itself: ~7 us, four times an expert)
        t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)
    return t.view(shape)


def _tensor_view(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """Zero-copy tensor over the uint8 tensor ``raw[offset:]`` (parts start PART_ALIGN-aligned,
    so the reinterpretation is always aligned)."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return raw[offset : offset + nbytes].view(dtype).view(shape)
