"""`FTWWriter`: stream dense tensors and expert blocks into one FTW file (layout in `layout.py`)."""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
from types import TracebackType
from typing import Any

import torch
import xxhash
import zstandard

from .codecs import EncodedTensor, get_codec
from .layout import (
    ALIGNMENT,
    BLOCK_HEADER_SIZE,
    BLOCK_MAGIC,
    BLOCK_STRUCT,
    COMPRESSION_IDS,
    DENSE_ALIGN,
    DTYPE_NAMES,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    HEADER_HASH_STRUCT,
    HEADER_STRUCT,
    MAGIC,
    PART_ALIGN,
    align_up,
    hex64,
)

logger = logging.getLogger(__name__)

_U32_MAX = 2**32 - 1
ZSTD_LEVEL = 3


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU tensor, C-contiguous, as a memoryview (no copy if contiguous)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class FTWWriter:
    """Write one FTW file. Use as a context manager; `close` finishes the file.

    Data goes to ``path + ".tmp"``; `close` writes the manifest at the end, rewrites the fixed
    header, fsyncs and atomically renames to ``path``. If the ``with`` block raises (or `abort` is
    called) the temporary file is removed and ``path`` is left untouched, so a crash never leaves a
    half-written file under the final name.

    Args:
        path: final file path.
        model_config: JSON-serialisable model configuration (stored verbatim).
        tokenizer_files: ``{file name: bytes}`` stored base64-encoded in the manifest.
        metadata: JSON-serialisable free-form metadata.

    Raises ValueError if ``model_config`` or ``metadata`` is not JSON-serialisable.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        model_config: dict[str, Any],
        tokenizer_files: dict[str, bytes] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("FTW files are written on little-endian hosts only")
        self.path = os.fspath(path)
        self.tmp_path = self.path + ".tmp"
        try:
            json.dumps(model_config)
            json.dumps(metadata or {})
        except (TypeError, ValueError) as e:
            raise ValueError(f"model_config and metadata must be JSON-serialisable: {e}") from e
        self._model_config = model_config
        self._metadata = dict(metadata or {})
        self._tokenizer_files = {
            str(k): base64.b64encode(bytes(v)).decode("ascii") for k, v in (tokenizer_files or {}).items()
        }
        self._dense: dict[str, dict[str, Any]] = {}
        self._experts: dict[tuple[int, int], dict[str, Any]] = {}
        self._closed = False
        self._f = open(self.tmp_path, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._pos = 0
        self._write(b"\0" * ALIGNMENT)  # header placeholder, rewritten by close()

    # -- low level -------------------------------------------------------------------------------
    def _write(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._pos += len(data)

    def _pad_to(self, alignment: int) -> None:
        pad = align_up(self._pos, alignment) - self._pos
        if pad:
            self._write(b"\0" * pad)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"FTWWriter for {self.path} is closed")

    # -- public API ------------------------------------------------------------------------------
    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        """Append a dense tensor (stored raw, 64-byte aligned, in its own dtype and shape).

        Raises ValueError on a duplicate name or an unsupported dtype (see `layout.DTYPES`).
        """
        self._check_open()
        if not isinstance(name, str) or not name:
            raise ValueError(f"dense tensor name must be a non-empty str, got {name!r}")
        if name in self._dense:
            raise ValueError(f"dense tensor {name!r} added twice")
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"dense tensor {name!r}: unsupported dtype {tensor.dtype}")
        data = tensor_bytes(tensor)
        self._pad_to(DENSE_ALIGN)
        offset = self._pos
        self._write(data)
        self._dense[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "offset": offset,
            "nbytes": len(data),
            "xxhash64": hex64(xxhash.xxh64_intdigest(data)),
        }

    def add_expert(
        self, layer: int, expert: int, tensors: dict[str, EncodedTensor], *, compress: bool = False
    ) -> None:
        """Append the block of expert ``expert`` of layer ``layer``.

        Args:
            tensors: ``{projection name: EncodedTensor}``; each is validated against its codec.
            compress: store the raw bytes as one zstd frame (always honoured, even if it does not
                shrink the data).

        Raises ValueError on a duplicate key, out-of-range ids or an invalid EncodedTensor.
        """
        self._check_open()
        for v, what in ((layer, "layer"), (expert, "expert")):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _U32_MAX:
                raise ValueError(f"{what} must be an int in [0, 2**32), got {v!r}")
        if (layer, expert) in self._experts:
            raise ValueError(f"expert (layer={layer}, expert={expert}) added twice")
        if not tensors:
            raise ValueError(f"expert (layer={layer}, expert={expert}) has no tensors")
        chunks: list[memoryview | bytes] = []
        raw_length = 0
        records: dict[str, Any] = {}
        for pname, enc in tensors.items():
            if not isinstance(enc, EncodedTensor):
                raise ValueError(f"expert ({layer}, {expert}) projection {pname!r} is not an EncodedTensor")
            get_codec(enc.codec).validate(enc)
            parts: dict[str, Any] = {}
            for part_name, t in enc.parts.items():
                pad = align_up(raw_length, PART_ALIGN) - raw_length
                if pad:
                    chunks.append(b"\0" * pad)
                    raw_length += pad
                data = tensor_bytes(t)
                parts[part_name] = {
                    "dtype": DTYPE_NAMES[t.dtype],
                    "shape": list(t.shape),
                    "offset_in_block": raw_length,
                    "nbytes": len(data),
                }
                chunks.append(data)
                raw_length += len(data)
            records[str(pname)] = {"codec": enc.codec, "shape": list(enc.shape), "parts": parts}

        if compress:
            stored_chunks: list[memoryview | bytes] = [
                zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(chunks))
            ]
            compression = "zstd"
        else:
            stored_chunks, compression = chunks, "none"
        h = xxhash.xxh64()
        for c in stored_chunks:
            h.update(c)
        stored_length = sum(len(c) for c in stored_chunks)
        digest = h.intdigest()

        self._pad_to(ALIGNMENT)
        offset = self._pos
        header = BLOCK_STRUCT.pack(
            BLOCK_MAGIC, layer, expert, stored_length, raw_length, digest, COMPRESSION_IDS[compression]
        )
        self._write(header.ljust(BLOCK_HEADER_SIZE, b"\0"))
        for c in stored_chunks:
            self._write(c)
        self._experts[(layer, expert)] = {
            "layer": layer,
            "expert": expert,
            "offset": offset,
            "stored_length": stored_length,
            "raw_length": raw_length,
            "compression": compression,
            "xxhash64": hex64(digest),
            "tensors": records,
        }

    def close(self) -> None:
        """Write the manifest and header, fsync and rename ``path.tmp`` to ``path``. Idempotent."""
        if self._closed:
            return
        try:
            manifest = {
                "format": {"major": FORMAT_MAJOR, "minor": FORMAT_MINOR},
                "model_config": self._model_config,
                "tokenizer_files": self._tokenizer_files,
                "metadata": self._metadata,
                "dense": self._dense,
                "experts": list(self._experts.values()),
            }
            blob = json.dumps(manifest, separators=(",", ":")).encode("utf-8")
            self._pad_to(DENSE_ALIGN)
            m_off = self._pos
            self._write(blob)
            head = HEADER_STRUCT.pack(
                MAGIC,
                FORMAT_MAJOR,
                FORMAT_MINOR,
                0,
                ALIGNMENT,
                m_off,
                len(blob),
                xxhash.xxh64_intdigest(blob),
            )
            head += HEADER_HASH_STRUCT.pack(xxhash.xxh64_intdigest(head))
            self._f.seek(0)
            self._f.write(head)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp_path, self.path)
            _fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        except BaseException:
            self.abort()
            raise
        self._closed = True
        logger.info(
            "wrote %s: %d dense tensors, %d expert blocks, %d bytes",
            self.path,
            len(self._dense),
            len(self._experts),
            self._pos,
        )

    def abort(self) -> None:
        """Discard the temporary file without touching ``path``. Idempotent."""
        self._closed = True
        try:
            self._f.close()
        finally:
            if os.path.exists(self.tmp_path):
                os.unlink(self.tmp_path)

    def __enter__(self) -> FTWWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            logger.warning("FTWWriter for %s aborted by %s; no file written", self.path, exc_type.__name__)
            self.abort()


def _fsync_dir(path: str) -> None:
    """Best-effort fsync of a directory so the rename is durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
