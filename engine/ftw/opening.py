"""What opening an FTW file reads and checks before anything else (layout in `layout.py`): the
fixed header (magic, checksum, major version, alignment) and the manifest (its bounds and
checksum, its JSON, every dense tensor's and expert block's record inside the data region), so a
truncated or foreign file fails at open, with the byte offset of the fault.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

import xxhash

from .blocks import ErrorAt
from .layout import (
    ALIGNMENT,
    FORMAT_MAJOR,
    HEADER_HASH_STRUCT,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    DenseInfo,
    ExpertInfo,
    parse_dense,
    parse_expert,
)


class Manifest(NamedTuple):
    """An opened file's header fields and manifest, every record checked."""

    version: tuple[int, int]
    flags: int
    model_config: dict[str, Any]
    metadata: dict[str, Any]
    tokenizer_b64: dict[str, str]  # file name -> base64 of its bytes
    dense: dict[str, DenseInfo]
    experts: dict[tuple[int, int], ExpertInfo]


def read_manifest(pread: Callable[[int, int], bytes], file_size: int, err: ErrorAt) -> Manifest:
    """Read and check the header and the manifest of a file of `file_size` bytes; `pread(n,
    offset)` returns exactly n bytes (or raises). FTWFormatError (built by `err`) on any fault."""
    if file_size < HEADER_SIZE:
        raise err(f"file truncated or not an FTW file: only {file_size} bytes", offset=0)
    head = pread(HEADER_SIZE, 0)
    fields = HEADER_STRUCT.unpack_from(head)
    magic, major, minor, flags, alignment, m_off, m_len, m_hash = fields
    if magic != MAGIC:
        raise err(f"not an FTW file: magic {magic!r}, expected {MAGIC!r}", offset=0)
    (h_hash,) = HEADER_HASH_STRUCT.unpack_from(head, HEADER_STRUCT.size)
    if xxhash.xxh64_intdigest(head[: HEADER_STRUCT.size]) != h_hash:
        raise err("header checksum mismatch (corrupted header)", offset=0)
    if major != FORMAT_MAJOR:
        raise err(
            f"unsupported FTW format version {major}.{minor}; this reader reads {FORMAT_MAJOR}.x",
            offset=4,
        )
    if alignment != ALIGNMENT:
        raise err(f"unsupported alignment {alignment}, expected {ALIGNMENT}", offset=12)
    if m_off < ALIGNMENT or m_off + m_len > file_size:
        raise err(
            f"file truncated: manifest spans [{m_off}, {m_off + m_len}) but the file has {file_size} bytes",
            offset=m_off,
        )
    blob = pread(m_len, m_off)
    if xxhash.xxh64_intdigest(blob) != m_hash:
        raise err("manifest checksum mismatch (corrupted manifest)", offset=m_off)
    try:
        man = json.loads(blob.decode("utf-8"))
        fmt = man["format"]
        if fmt["major"] != major or fmt["minor"] != minor:
            raise ValueError(f"manifest format {fmt} disagrees with header {major}.{minor}")
        model_config: dict[str, Any] = man["model_config"]
        metadata: dict[str, Any] = man["metadata"]
        tokenizer_b64: dict[str, str] = dict(man["tokenizer_files"])
        dense = {name: parse_dense(name, rec) for name, rec in man["dense"].items()}
        experts: dict[tuple[int, int], ExpertInfo] = {}
        for rec in man["experts"]:
            info = parse_expert(rec)
            if (info.layer, info.expert) in experts:
                raise ValueError(f"duplicate expert ({info.layer}, {info.expert})")
            experts[(info.layer, info.expert)] = info
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
        raise err(f"malformed manifest: {e!r}", offset=m_off) from e
    for d in dense.values():
        if d.offset < ALIGNMENT or d.offset + d.nbytes > m_off:
            raise err(f"dense tensor {d.name!r} lies outside the data region", offset=d.offset)
    for key, x in experts.items():
        if x.offset < ALIGNMENT or x.data_offset + x.stored_length > m_off:
            raise err("block lies outside the data region", offset=x.offset, key=key)
    return Manifest((major, minor), flags, model_config, metadata, tokenizer_b64, dense, experts)
