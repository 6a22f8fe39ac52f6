"""The structure of one GGUF file, parsed and checked with plain, bounded file reads.

A GGUF file is a header (magic, version, tensor count, metadata count), the metadata (key, value
type, value; arrays carry an item type and a count), the tensor directory (name, dims, type, offset)
and the aligned tensor data. `read_layout` walks all of it and checks every count, length, dim,
type and offset against the bytes the file really has *before* it loops over or allocates
anything, so a hostile header (an array claiming 2**40 items in a 121-byte file) is one
`CheckpointError` line at once rather than a loop over bytes past the end (gguf-py's reader
does that, growing memory). Nothing is memory-mapped: tensor bytes are read later with ordinary
reads (`FileSpan`), so a file truncated while it converts gives a short read and a
`CheckpointError`, never a SIGBUS. The limits follow llama.cpp's own loader (gguf.cpp): at most
4 dims, no nested arrays, ``general.alignment`` a power of two, tensor offsets aligned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ...errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
SMALL_ARRAY = 4096  # longer metadata arrays (token lists, merges) are checked and skipped, not decoded
_CHUNK = 1 << 20
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct code of a scalar (the GGUF spec's numbering, as `gguf.GGUFValueType`)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_UINT32 = 4
# GGML types that gguf-py exposes as typed numpy arrays (the others: raw bytes, blocks per row)
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16}
_TYPED |= {"I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class FileSpan:
    """Where a tensor's bytes lie in its file, read on demand with ordinary reads.

    `shape` is the numpy shape gguf-py gives the data (torch order; for block-quantized types the
    last dim counts bytes), `dtype` its item type in the file's byte order.
    """

    file: Path
    name: str
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def read(self, index: int | None = None) -> np.ndarray:
        """The whole array, or its slice ``[index]`` along the first dim (one expert of a stack),
        in native byte order. CheckpointError when the file is now shorter than its directory says."""
        offset, nbytes, shape = self.offset, self.nbytes, self.shape
        if index is not None:
            if not 0 <= index < shape[0]:
                raise CheckpointError(
                    f"{self.file}: tensor '{self.name}' has {shape[0]} slices, slice {index} was asked for"
                )
            nbytes //= shape[0]
            offset += index * nbytes
            shape = shape[1:]
        buf = bytearray(nbytes)
        got = _read_into(self.file, offset, memoryview(buf))
        if got < nbytes:
            raise CheckpointError(
                f"{self.file}: truncated GGUF file: tensor '{self.name}' needs bytes "
                f"{offset}..{offset + nbytes}, the file now ends at byte {offset + got}"
            )
        arr = np.frombuffer(buf, dtype=self.dtype).reshape(shape)
        return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def _read_into(path: Path, offset: int, out: memoryview) -> int:
    """Bytes read into `out` from `offset` (fewer only at the end of the file)."""
    got = 0
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            while got < len(out):
                n = f.readinto(out[got:])
                if not n:
                    break
                got += n
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None
    return got


@dataclass
class Layout:
    """One GGUF file's metadata and tensor directory (see the module doc)."""

    path: Path
    size: int
    byte_order: str  # "<" or ">"
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)  # arrays of > SMALL_ARRAY items left out
    array_lengths: dict[str, int] = field(default_factory=dict)  # every metadata array's item count
    tensors: dict[str, tuple[Any, tuple[int, ...], FileSpan]] = field(default_factory=dict)
    kv_span: tuple[int, int] = (0, 0)  # where the metadata lies: [start, end)
    kv_count: int = 0

    def metadata_only(self) -> bytes:
        """This file's header and metadata as a GGUF with no tensors (for readers that map the
        whole file, such as transformers' tokenizer builder: they get a private copy)."""
        start, end = self.kv_span
        buf = bytearray(end - start)
        if _read_into(self.path, start, memoryview(buf)) < len(buf):
            raise CheckpointError(f"{self.path}: truncated GGUF file: its metadata ends past the end")
        head = struct.pack(f"{self.byte_order}IQQ", self.version, 0, self.kv_count)
        return MAGIC + head + bytes(buf)


class _Cursor:
    """Sequential reads of a file through a 1 MiB window; every read is checked against the size
    first, so a length field can never make it read (or allocate) past the end."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f, self.path, self.size = f, path, size
        self.pos = 0
        self.order = "<"
        self._buf = b""
        self._buf_pos = 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"{what} at byte {self.pos} needs {n} bytes, the file has {self.size - self.pos} left"
            )

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        start = self.pos - self._buf_pos
        if start < 0 or start + n > len(self._buf):
            self.f.seek(self.pos)
            want = min(max(n, _CHUNK), self.size - self.pos)  # never more than the file has
            self._buf, self._buf_pos, start = self.f.read(want), self.pos, 0
            if len(self._buf) < n:  # the file shrank since it was measured
                raise self.fail(f"{what} at byte {self.pos}: the file ends early")
        self.pos += n
        return self._buf[start : start + n]

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def skip_strings(self, count: int, key: str) -> None:
        """Walk `count` strings, checking every length, without decoding them (token lists: the
        buffered fast path keeps a 300k-item list well under a second)."""
        unpack = struct.Struct(self.order + "Q").unpack_from
        for i in range(count):
            start = self.pos - self._buf_pos
            if start + 8 <= len(self._buf):
                n = unpack(self._buf, start)[0]
                self.pos += 8
            else:
                n = self.scalar("Q", f"the length of item {i} of {key!r}")
            self.skip(n, f"item {i} of {key!r}")

    def scalar(self, code: str, what: str) -> Any:
        return struct.unpack(self.order + code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("Q", f"{what} length"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {self.pos - len(raw)} is not UTF-8") from None


def read_layout(path: Path) -> Layout:
    """Parse and check the GGUF file `path` (see the module doc); CheckpointError naming the file
    and what is wrong."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            cur = _Cursor(f, path, size)
            return _parse(cur)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None


def _parse(cur: _Cursor) -> Layout:
    magic = cur.take(4, "the magic")
    if magic != MAGIC:
        raise cur.fail(f"the file starts with {magic!r}, not {MAGIC!r}")
    version = cur.scalar("I", "the version")
    if version & 0xFFFF == 0:  # written on a big-endian host (as gguf-py detects it)
        cur.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in VERSIONS:
        raise cur.fail(f"version {version} (supported: {', '.join(map(str, VERSIONS))})")
    n_tensors = cur.scalar("Q", "the tensor count")
    n_kv = cur.scalar("Q", "the metadata count")
    # smallest entries: a 0-byte key, a type and a 1-byte value; a 0-byte name, 1 dim, type, offset
    cur.need(n_kv * 13 + n_tensors * 32, f"{n_kv} metadata entries and {n_tensors} tensors")
    out = Layout(cur.path, cur.size, cur.order, version, kv_count=n_kv)
    types: dict[str, int] = {}
    start = cur.pos
    for _ in range(n_kv):
        key = cur.string("a metadata key")
        if key in types:
            raise cur.fail(f"metadata key {key!r} appears twice")
        types[key] = cur.scalar("I", f"the type of {key!r}")
        _read_value(cur, key, types[key], out)
    out.kv_span = (start, cur.pos)
    alignment = 32  # GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in types:
        alignment = out.metadata["general.alignment"]
        if types["general.alignment"] != _UINT32 or not alignment or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment {alignment!r} is not a power of two (uint32)")
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    for name, qtype, dims, offset, nbytes in infos:
        if name in out.tensors:
            raise cur.fail(f"tensor {name!r} appears twice")
        if offset % alignment:
            raise cur.fail(f"tensor {name!r} has offset {offset}, not a multiple of alignment {alignment}")
        begin = data_start + offset
        if begin + nbytes > cur.size:
            raise cur.fail(
                f"tensor {name!r} ({qtype.name} {list(dims)}) needs bytes {begin}..{begin + nbytes}, "
                f"the file has {cur.size}"
            )
        shape = tuple(reversed(dims))  # torch order
        if qtype.name in _TYPED:
            dtype, np_shape = np.dtype(_TYPED[qtype.name]).newbyteorder(cur.order), shape
        else:  # raw blocks, as gguf-py shows them: the last dim counts the bytes of a row
            dtype, np_shape = np.dtype(np.uint8), (*shape[:-1], nbytes // (_count(shape[:-1]) or 1))
        out.tensors[name] = (qtype, shape, FileSpan(cur.path, name, begin, nbytes, dtype, np_shape))
    return out


def _read_value(cur: _Cursor, key: str, vtype: int, out: Layout) -> None:
    """One metadata value into `out.metadata` (arrays: their length into `out.array_lengths`)."""
    if vtype in _SCALARS:
        out.metadata[key] = cur.scalar(_SCALARS[vtype], f"the value of {key!r}")
    elif vtype == _STRING:
        out.metadata[key] = cur.string(f"the value of {key!r}")
    elif vtype == _ARRAY:
        itype = cur.scalar("I", f"the item type of {key!r}")
        count = cur.scalar("Q", f"the length of {key!r}")
        if itype == _ARRAY:
            raise cur.fail(f"metadata {key!r} is an array of arrays (not supported, as in llama.cpp)")
        if itype != _STRING and itype not in _SCALARS:
            raise cur.fail(f"metadata array {key!r} has unknown item type {itype}")
        item = 8 if itype == _STRING else struct.calcsize(_SCALARS[itype])
        cur.need(count * item, f"metadata array {key!r} of {count} items")  # before any loop
        out.array_lengths[key] = count
        if count <= SMALL_ARRAY:
            read = cur.string if itype == _STRING else (lambda what: cur.scalar(_SCALARS[itype], what))
            out.metadata[key] = [read(f"item {i} of {key!r}") for i in range(count)]
        elif itype == _STRING:  # token lists: every length checked, the bytes skipped
            cur.skip_strings(count, key)
        else:
            cur.skip(count * item, f"metadata array {key!r}")
    else:
        raise cur.fail(f"metadata {key!r} has unknown value type {vtype}")


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, Any, tuple[int, ...], int, int]:
    """(name, type, dims innermost first, offset from the data start, bytes) of directory entry `i`."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = cur.string(f"the name of tensor {i}")
    n_dims = cur.scalar("I", f"the dim count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dims (1 to {MAX_DIMS} allowed)")
    dims = tuple(cur.scalar("Q", f"a dim of tensor {name!r}") for _ in range(n_dims))
    raw_type = cur.scalar("I", f"the type of tensor {name!r}")
    offset = cur.scalar("Q", f"the offset of tensor {name!r}")
    try:
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name!r} has unknown type {raw_type}") from None
    if any(d < 1 for d in dims) or dims[0] % block:
        raise cur.fail(f"tensor {name!r} has dims {list(dims)} (each >= 1, the first a multiple of {block})")
    return name, qtype, dims, offset, _count(dims) // block * type_size


def _count(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
