"""`FTWFile`: open, validate and read an FTW file (layout in `layout.py`).

Opening reads and checks the fixed header and the manifest (checksums, version, every record's
bounds), so a truncated or foreign file fails at open. Nothing is memory-mapped: dense tensors are
read with ``os.preadv`` into tensors of their own (a file changed or truncated afterwards cannot
change them or fault on them: a map of a shrunk file raises SIGBUS, a shared page silently takes
the new bytes), and expert blocks are read with ``os.pread`` on demand, one block at a time, and
verified against their checksum before anything is decoded. A read that comes back short raises
FTWFormatError ("file truncated"), a checksum that no longer matches raises FTWFormatError naming
the tensor or block. Reading is thread-safe.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import threading
import warnings
from types import TracebackType
from typing import Any

import torch
import xxhash
import zstandard

from ..errors import FTWFormatError
from .codecs import EncodedTensor, get_codec
from .layout import (
    ALIGNMENT,
    BLOCK_HEADER_SIZE,
    BLOCK_MAGIC,
    BLOCK_STRUCT,
    COMPRESSION_IDS,
    DTYPES,
    FORMAT_MAJOR,
    HEADER_HASH_STRUCT,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    DenseInfo,
    ExpertInfo,
    hex64,
    parse_dense,
    parse_expert,
)

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview


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


class FTWFile:
    """A read-only FTW file.

    Args:
        path: the file to open. Raises `FTWFormatError` (naming the file and byte offset) if it is
            truncated, not an FTW file, of another major version, or fails a header/manifest check.

    Attributes:
        path: the file path.
        bytes_read: number of expert-block bytes (block header + stored bytes) read from the file
            so far, by any method; dense tensor reads are not counted.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.bytes_read = 0
        self._lock = threading.Lock()
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            raise FTWFormatError(f"{self.path}: cannot open FTW file: {e}") from e
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    # -- opening ---------------------------------------------------------------------------------
    def _err(
        self, msg: str, *, offset: int | None = None, key: tuple[int, int] | None = None
    ) -> FTWFormatError:
        where = ""
        if key is not None:
            where += f" expert block (layer={key[0]}, expert={key[1]})"
        if offset is not None:
            where += f" at byte offset {offset}"
        return FTWFormatError(f"{self.path}:{where}: {msg}" if where else f"{self.path}: {msg}")

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        if len(data) < n and data:  # very large reads may come back short: read the rest
            chunks = [data]
            got = len(data)
            while got < n:
                more = os.pread(self._fd, min(n - got, 1 << 30), offset + got)
                if not more:
                    break
                chunks.append(more)
                got += len(more)
            data = b"".join(chunks)
        if len(data) != n:
            raise self._err(f"file truncated: wanted {n} bytes, got {len(data)}", offset=offset)
        return data

    def _load(self) -> None:
        self.file_size = os.fstat(self._fd).st_size
        if self.file_size < HEADER_SIZE:
            raise self._err(f"file truncated or not an FTW file: only {self.file_size} bytes", offset=0)
        head = self._pread(HEADER_SIZE, 0)
        fields = HEADER_STRUCT.unpack_from(head)
        magic, major, minor, flags, alignment, m_off, m_len, m_hash = fields
        if magic != MAGIC:
            raise self._err(f"not an FTW file: magic {magic!r}, expected {MAGIC!r}", offset=0)
        (h_hash,) = HEADER_HASH_STRUCT.unpack_from(head, HEADER_STRUCT.size)
        if xxhash.xxh64_intdigest(head[: HEADER_STRUCT.size]) != h_hash:
            raise self._err("header checksum mismatch (corrupted header)", offset=0)
        if major != FORMAT_MAJOR:
            raise self._err(
                f"unsupported FTW format version {major}.{minor}; this reader reads {FORMAT_MAJOR}.x",
                offset=4,
            )
        if alignment != ALIGNMENT:
            raise self._err(f"unsupported alignment {alignment}, expected {ALIGNMENT}", offset=12)
        self.version = (major, minor)
        self.flags = flags
        if m_off < ALIGNMENT or m_off + m_len > self.file_size:
            raise self._err(
                f"file truncated: manifest spans [{m_off}, {m_off + m_len}) but the file has "
                f"{self.file_size} bytes",
                offset=m_off,
            )
        blob = self._pread(m_len, m_off)
        if xxhash.xxh64_intdigest(blob) != m_hash:
            raise self._err("manifest checksum mismatch (corrupted manifest)", offset=m_off)
        try:
            man = json.loads(blob.decode("utf-8"))
            fmt = man["format"]
            if fmt["major"] != major or fmt["minor"] != minor:
                raise ValueError(f"manifest format {fmt} disagrees with header {major}.{minor}")
            self._model_config: dict[str, Any] = man["model_config"]
            self._metadata: dict[str, Any] = man["metadata"]
            self._tokenizer_b64: dict[str, str] = dict(man["tokenizer_files"])
            self._dense = {name: parse_dense(name, rec) for name, rec in man["dense"].items()}
            self._experts: dict[tuple[int, int], ExpertInfo] = {}
            for rec in man["experts"]:
                info = parse_expert(rec)
                if (info.layer, info.expert) in self._experts:
                    raise ValueError(f"duplicate expert ({info.layer}, {info.expert})")
                self._experts[(info.layer, info.expert)] = info
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
            raise self._err(f"malformed manifest: {e!r}", offset=m_off) from e
        for d in self._dense.values():
            if d.offset < ALIGNMENT or d.offset + d.nbytes > m_off:
                raise self._err(f"dense tensor {d.name!r} lies outside the data region", offset=d.offset)
        for key, x in self._experts.items():
            if x.offset < ALIGNMENT or x.data_offset + x.stored_length > m_off:
                raise self._err("block lies outside the data region", offset=x.offset, key=key)
        logger.debug(
            "opened %s: FTW %d.%d, %d dense, %d experts",
            self.path,
            major,
            minor,
            len(self._dense),
            len(self._experts),
        )

    # -- metadata --------------------------------------------------------------------------------
    @property
    def model_config(self) -> dict[str, Any]:
        """The model configuration stored by the writer (the parsed JSON; do not mutate)."""
        return self._model_config

    @property
    def metadata(self) -> dict[str, Any]:
        """Free-form metadata stored by the writer."""
        return self._metadata

    @property
    def tokenizer_files(self) -> dict[str, bytes]:
        """``{file name: bytes}`` of the tokenizer files (decoded on each access)."""
        try:
            return {k: base64.b64decode(v, validate=True) for k, v in self._tokenizer_b64.items()}
        except (binascii.Error, TypeError) as e:
            raise self._err(f"malformed tokenizer file in manifest: {e}") from e

    # -- dense -----------------------------------------------------------------------------------
    def dense_names(self) -> list[str]:
        """Names of the dense tensors, in file order."""
        return list(self._dense)

    def dense_info(self, name: str) -> DenseInfo:
        """Manifest record of dense tensor ``name``; FTWFormatError for an unknown name."""
        try:
            return self._dense[name]
        except KeyError:
            raise self._err(f"no dense tensor named {name!r}") from None

    def dense(self, name: str, *, verify: bool = False) -> torch.Tensor:
        """Dense tensor ``name`` (its stored dtype and shape), read from the file into memory it owns.

        Every call reads the file again and returns a new tensor: writing to it never reaches the
        file or another caller, and a later change to the file never reaches it. FTWFormatError when
        the file is closed or now shorter than the tensor's bytes ("file truncated"), and with
        ``verify=True`` when its bytes no longer match the manifest's xxhash64.
        """
        d = self.dense_info(name)
        tensor = torch.empty(d.shape, dtype=DTYPES[d.dtype])
        if d.nbytes == 0:
            return tensor
        if self._fd < 0:
            raise self._err("file is closed")
        buf = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        if len(buf) != d.nbytes:
            raise self._err(f"dense tensor {name!r}: {d.nbytes} bytes cannot hold {list(d.shape)} {d.dtype}")
        self._pread_into(buf, d.offset)
        if verify and hex64(xxhash.xxh64_intdigest(buf)) != d.xxhash64:
            raise self._err(f"dense tensor {name!r}: checksum mismatch", offset=d.offset)
        return tensor

    def _pread_into(self, buf: memoryview, offset: int) -> None:
        """Fill `buf` from the file at `offset` (FTWFormatError if the file ends first)."""
        got = 0
        while got < len(buf):
            n = os.preadv(self._fd, [buf[got : got + (1 << 30)]], offset + got)
            if n == 0:
                raise self._err(f"file truncated: wanted {len(buf)} bytes, got {got}", offset=offset)
            got += n

    # -- experts ---------------------------------------------------------------------------------
    def expert_keys(self) -> list[tuple[int, int]]:
        """``(layer, expert)`` of every expert block, sorted."""
        return sorted(self._experts)

    def expert_info(self, layer: int, expert: int) -> ExpertInfo:
        """Manifest record of one block; FTWFormatError for an unknown key."""
        try:
            return self._experts[(layer, expert)]
        except (KeyError, TypeError):
            raise self._err(f"no expert block (layer={layer}, expert={expert}) in this file") from None

    def read_expert_bytes(self, layer: int, expert: int) -> bytes:
        """Read one block's stored bytes (possibly compressed), verified against header and checksum.

        Adds the block's header + stored size to `bytes_read`. FTWFormatError on any mismatch.
        """
        info = self.expert_info(layer, expert)
        if self._fd < 0:
            raise self._err("file is closed")
        head = self._pread(BLOCK_HEADER_SIZE, info.offset)
        stored = self._pread(info.stored_length, info.data_offset)
        with self._lock:
            self.bytes_read += BLOCK_HEADER_SIZE + info.stored_length
        self.check_block(info, head, stored)
        return stored

    def check_block(self, info: ExpertInfo, head: Buffer, stored: Buffer) -> None:
        """Check one block as read from disk: its header (`head`, at least `BLOCK_STRUCT.size`
        bytes) against the manifest record `info`, its stored bytes against their length and
        xxhash64. The one check of every path that reads blocks (`read_expert_bytes`, and
        `memory.storage.BlockReader` past the page cache). FTWFormatError naming the block and
        the byte offset of the first mismatch."""
        key = (info.layer, info.expert)
        magic, b_layer, b_expert, s_len, r_len, digest, comp = BLOCK_STRUCT.unpack_from(head)
        if magic != BLOCK_MAGIC:
            raise self._err(
                f"bad block magic {magic!r}, expected {BLOCK_MAGIC!r}", offset=info.offset, key=key
            )
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
            raise self._err(
                f"block header (layer, expert, stored_length, raw_length, xxhash64, compression) = {got} "
                f"disagrees with the manifest {want}",
                offset=info.offset,
                key=key,
            )
        self._check_stored(info, stored)

    def _check_stored(self, info: ExpertInfo, stored: Buffer) -> None:
        key = (info.layer, info.expert)
        if len(stored) != info.stored_length:
            raise self._err(
                f"stored bytes have length {len(stored)}, expected {info.stored_length}",
                offset=info.data_offset,
                key=key,
            )
        h = hex64(xxhash.xxh64_intdigest(stored))
        if h != info.xxhash64:
            raise self._err(
                f"checksum mismatch over bytes [{info.data_offset}, "
                f"{info.data_offset + info.stored_length}): xxhash64 {h}, manifest says "
                f"{info.xxhash64} (corrupted block)",
                offset=info.data_offset,
                key=key,
            )

    def _raw(self, info: ExpertInfo, stored: Buffer) -> Buffer:
        if info.compression == "none":
            return stored
        key = (info.layer, info.expert)
        try:
            # zstandard allocates the size the frame header declares: check it before decompressing.
            declared = zstandard.frame_content_size(stored)
            if declared not in (-1, info.raw_length):
                raise self._err(
                    f"zstd frame declares {declared} bytes of content, the manifest's raw_length is "
                    f"{info.raw_length}",
                    offset=info.data_offset,
                    key=key,
                )
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=info.raw_length)
        except zstandard.ZstdError as e:
            raise self._err(f"zstd decompression failed: {e}", offset=info.data_offset, key=key) from e
        except MemoryError as e:  # a raw_length no machine can hold
            raise self._err(
                f"cannot allocate {info.raw_length} bytes to decompress the block",
                offset=info.data_offset,
                key=key,
            ) from e
        if len(raw) != info.raw_length:
            raise self._err(
                f"decompressed to {len(raw)} bytes, expected {info.raw_length}",
                offset=info.data_offset,
                key=key,
            )
        return raw

    def _encoded(self, info: ExpertInfo, raw: Buffer | torch.Tensor) -> dict[str, EncodedTensor]:
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
                raise self._err(f"projection {pname!r}: {e}", offset=info.offset, key=key) from e
            out[pname] = enc
        return out

    def encoded_expert(self, layer: int, expert: int) -> dict[str, EncodedTensor]:
        """Read and verify one block and return its projections undecoded (parts as stored).

        The parts are zero-copy views of the block's raw bytes; treat them as read-only.
        """
        info = self.expert_info(layer, expert)
        return self._encoded(info, self._raw(info, self.read_expert_bytes(layer, expert)))

    def encoded_stored(
        self, layer: int, expert: int, stored: Buffer, *, verify: bool = True
    ) -> dict[str, EncodedTensor]:
        """Stored bytes already read with `read_expert_bytes` -> the block's projections undecoded
        (parts as stored: zero-copy views of `stored` unless the block is compressed; treat them
        as read-only). `verify`: as in `decode_stored`."""
        info = self.expert_info(layer, expert)
        if verify or len(stored) != info.stored_length:
            self._check_stored(info, stored)
        return self._encoded(info, self._raw(info, stored))

    def decode_stored(
        self,
        layer: int,
        expert: int,
        stored: Buffer,
        dtype: torch.dtype = torch.float32,
        *,
        verify: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Decode stored bytes already read with `read_expert_bytes` (e.g. kept in a host-RAM tier).

        Args:
            stored: the block's stored bytes, exactly as `read_expert_bytes` returned them.
            dtype: floating dtype of the decoded weights.
            verify: recheck the xxhash64 (the length is always checked); pass False for bytes that
                were verified when read and kept in memory since.

        Returns ``{projection name: tensor of its logical shape}``. Tensors may share memory with
        ``stored`` (fp32/bf16 codecs decoded to their own dtype); treat them as read-only.
        """
        encs = self.encoded_stored(layer, expert, stored, verify=verify)
        return {pname: get_codec(enc.codec).decode(enc, dtype) for pname, enc in encs.items()}

    def raw_bytes(self, layer: int, expert: int, stored: Buffer) -> Buffer:
        """The raw (decompressed) bytes of a block whose verified stored bytes are `stored`: the
        form `decode_raw` takes, and the bytes a GPU tier receives (the same object when the
        block is not compressed)."""
        info = self.expert_info(layer, expert)
        if len(stored) != info.stored_length:
            self._check_stored(info, stored)
        return self._raw(info, stored)

    def encoded_raw(self, layer: int, expert: int, raw: torch.Tensor) -> dict[str, EncodedTensor]:
        """A block's raw bytes held in a uint8 tensor on any device (see `raw_bytes`) -> its
        projections undecoded (parts: views of `raw`). The bytes must have been verified when
        read (the checksum covers the stored form); the length is checked."""
        info = self.expert_info(layer, expert)
        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != info.raw_length:
            raise self._err(
                f"raw bytes must be a 1-D uint8 tensor of {info.raw_length} bytes, got "
                f"{raw.dtype} {list(raw.shape)}",
                offset=info.data_offset,
                key=(layer, expert),
            )
        return self._encoded(info, raw)

    def decode_raw(
        self, layer: int, expert: int, raw: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> dict[str, torch.Tensor]:
        """Decode a block's raw bytes held in a uint8 tensor on any device (`encoded_raw`): the
        codec runs where the bytes are, so a GPU that received the compact block decodes it
        itself. Returns what `decode_stored` returns, on `raw.device`."""
        encs = self.encoded_raw(layer, expert, raw)
        return {pname: get_codec(enc.codec).decode(enc, dtype) for pname, enc in encs.items()}

    def decode_expert(
        self, layer: int, expert: int, dtype: torch.dtype = torch.float32
    ) -> dict[str, torch.Tensor]:
        """Read, verify, decompress and decode one expert block (see `decode_stored`)."""
        stored = self.read_expert_bytes(layer, expert)
        return self.decode_stored(layer, expert, stored, dtype, verify=False)

    def verify(self, progress: bool = False) -> None:
        """Check every dense tensor's and expert block's checksum, block headers and decompression.

        Raises FTWFormatError at the first bad item. ``progress=True`` shows a tqdm bar.
        """
        from tqdm import tqdm

        for name in self._dense:
            self.dense(name, verify=True)
        for layer, expert in tqdm(
            self.expert_keys(),
            desc=f"verify {os.path.basename(self.path)}",
            unit="block",
            disable=not progress,
        ):
            info = self._experts[(layer, expert)]
            self._encoded(info, self._raw(info, self.read_expert_bytes(layer, expert)))

    # -- lifetime --------------------------------------------------------------------------------
    def fileno(self) -> int:
        """The open file's descriptor (-1 once closed): the inode this reader reads, even if the
        path has been replaced since (the model fingerprint hashes through it)."""
        return self._fd

    def close(self) -> None:
        """Close the file. Idempotent. Dense tensors returned earlier own their memory and stay valid."""
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> FTWFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        n = len(getattr(self, "_experts", {}))
        return f"FTWFile({self.path!r}, version={getattr(self, 'version', None)}, experts={n})"
