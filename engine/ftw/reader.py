"""`FTWFile`: open, validate and read an FTW file (layout in `layout.py`).

Opening reads and checks the fixed header and the manifest (checksums, version, every record's
bounds), so a truncated or foreign file fails at open. Nothing is memory-mapped: dense tensors are
read with ``os.preadv`` into tensors of their own (a file changed or truncated afterwards cannot
change them or fault on them: a map of a shrunk file raises SIGBUS, a shared page silently takes
the new bytes), and expert blocks are read with ``os.pread`` on demand, one block at a time, and
verified against their checksum before anything is decoded. A read that comes back short raises
FTWFormatError ("file truncated"), a checksum that no longer matches raises FTWFormatError naming
the tensor or block. Reading is thread-safe. The checks themselves: `opening.py` (header and
manifest), `blocks.py` (each expert block, its decompression and its projections).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import threading
from types import TracebackType
from typing import Any

import torch
import xxhash

from ..errors import FTWFormatError
from . import blocks
from .blocks import Buffer
from .codecs import EncodedTensor, get_codec
from .layout import BLOCK_HEADER_SIZE, DTYPES, DenseInfo, ExpertInfo, hex64
from .opening import read_manifest

logger = logging.getLogger(__name__)


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
        manifest = read_manifest(self._pread, self.file_size, self._err)
        self.version, self.flags = manifest.version, manifest.flags
        self._model_config: dict[str, Any] = manifest.model_config
        self._metadata: dict[str, Any] = manifest.metadata
        self._tokenizer_b64: dict[str, str] = manifest.tokenizer_b64
        self._dense: dict[str, DenseInfo] = manifest.dense
        self._experts: dict[tuple[int, int], ExpertInfo] = manifest.experts
        logger.debug(
            "opened %s: FTW %d.%d, %d dense, %d experts",
            self.path,
            *self.version,
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
        blocks.check_block(info, head, stored, self._err)

    def _projections(self, info: ExpertInfo, stored: Buffer) -> dict[str, EncodedTensor]:
        """A block's verified stored bytes -> its projections undecoded (`blocks.projections`)."""
        return blocks.projections(info, blocks.raw_of(info, stored, self._err), self._err)

    def encoded_expert(self, layer: int, expert: int) -> dict[str, EncodedTensor]:
        """Read and verify one block and return its projections undecoded (parts as stored).

        The parts are zero-copy views of the block's raw bytes; treat them as read-only.
        """
        info = self.expert_info(layer, expert)
        return self._projections(info, self.read_expert_bytes(layer, expert))

    def encoded_stored(
        self, layer: int, expert: int, stored: Buffer, *, verify: bool = True
    ) -> dict[str, EncodedTensor]:
        """Stored bytes already read with `read_expert_bytes` -> the block's projections undecoded
        (parts as stored: zero-copy views of `stored` unless the block is compressed; treat them
        as read-only). `verify`: as in `decode_stored`."""
        info = self.expert_info(layer, expert)
        if verify or len(stored) != info.stored_length:
            blocks.check_stored(info, stored, self._err)
        return self._projections(info, stored)

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
            blocks.check_stored(info, stored, self._err)
        return blocks.raw_of(info, stored, self._err)

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
        return blocks.projections(info, raw, self._err)

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
            self._projections(info, self.read_expert_bytes(layer, expert))

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
