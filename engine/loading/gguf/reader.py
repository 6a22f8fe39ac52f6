"""Open a GGUF file (llama.cpp / Ollama weights) behind the engine's errors.

`GGUFSource` reads the metadata and the tensor directory of one GGUF model, split files included
(``name-00001-of-00003.gguf``: every part is opened and their tensors pooled; the metadata is the
first part's). The structure is parsed and checked by `layout.read_layout` with bounded reads
before anything else touches the file, and tensor bytes are read on demand with ordinary file
reads (never memory-mapped: a file truncated while it converts is a `CheckpointError`, not a
SIGBUS). gguf-py supplies the type tables and the reference dequantizer; anything it raises on a
tensor it cannot decode becomes a `CheckpointError` with one line naming the file.

Shapes: GGUF lists dims innermost first (``ne``); `GGUFTensor.shape` is the torch order (outermost
first), e.g. ``[out, in]`` for a linear weight and ``[E, out, in]`` for stacked experts.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import CheckpointError
from .layout import FileSpan, Layout, read_layout

logger = logging.getLogger(__name__)

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # a declared dependency; the hint is for broken environments
        raise CheckpointError("loading a GGUF file needs the 'gguf' package: pip install 'gguf>=0.10'") from e
    return gguf


def is_gguf_path(path: Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix: the file may not exist yet)."""
    return path.suffix.lower() == ".gguf"


def gguf_parts(path: Path) -> list[Path]:
    """Every file of the GGUF model `path` names: itself, or all parts of a split GGUF (any part may be
    named). CheckpointError when a part is missing."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF is missing part(s) {', '.join(missing)}")
    return parts


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: name, type (`gguf.GGMLQuantizationType`), torch-order shape and
    its data: where it lies in the file (`FileSpan`, read on demand), or an array in memory (numpy,
    shaped as `gguf.GGUFReader` exposes it)."""

    name: str
    qtype: Any
    shape: tuple[int, ...]
    data: np.ndarray | FileSpan
    file: Path

    @property
    def type_name(self) -> str:
        return self.qtype.name


class GGUFSource:
    """Metadata and tensors of one GGUF model (all parts of a split file).

    Raises CheckpointError (one line, naming the file) when the file does not exist, is not a GGUF
    file, is truncated or garbled, or holds a tensor type the `gguf` package does not know.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        self.parts = gguf_parts(self.path)
        _gguf()  # the type tables and the dequantizer: a clear error when the package is missing
        self._layouts: list[Layout] = [read_layout(part) for part in self.parts]
        self.tensors: dict[str, GGUFTensor] = {}
        for layout in self._layouts:
            for name, (qtype, shape, span) in layout.tensors.items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"{layout.path}: tensor {name!r} is also in another part of the GGUF"
                    )
                self.tensors[name] = GGUFTensor(name, qtype, shape, span, layout.path)
        first = self._layouts[0]
        self.metadata: dict[str, Any] = first.metadata
        self._array_lengths = first.array_lengths
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: GGUF metadata has no general.architecture")
        self.arch: str = arch

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value ``key`` (``{arch}`` is replaced by the architecture), else `default`."""
        return self.metadata.get(key.format(arch=self.arch), default)

    def array_length(self, key: str) -> int | None:
        """Number of items of the metadata array ``key`` (None when absent)."""
        return self._array_lengths.get(key)

    def metadata_only(self) -> bytes:
        """The first part's header and metadata as a GGUF file with no tensors: a private copy for
        readers that map the whole file (transformers' tokenizer builder), so that they never see
        a file that changes while it converts."""
        return self._layouts[0].metadata_only()

    def tensor(self, name: str) -> GGUFTensor:
        """The tensor called `name`; CheckpointError naming the file when it is missing."""
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: GGUF file has no tensor '{name}'")
        return t

    def has(self, name: str) -> bool:
        return name in self.tensors

    def float_tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` dequantized with `gguf.quants.dequantize` (the reference decoder), in its
        torch-order shape: float32, or bfloat16 for a BF16 tensor (the values exactly)."""
        t = self.tensor(name)
        return dequantize(t, self.path)


def dequantize(t: GGUFTensor, where: Path, index: int | None = None) -> torch.Tensor:
    """`t` (or its slice ``t[index]`` of stacked experts) dequantized by gguf-py: float32, or
    bfloat16 for BF16 data (exact). CheckpointError for a type gguf-py cannot decode."""
    gguf = _gguf()
    data = _array(t, index)
    shape = t.shape if index is None else t.shape[1:]
    try:
        if t.qtype == gguf.GGMLQuantizationType.BF16:
            raw = np.ascontiguousarray(data).view(np.uint16).astype(np.int16)
            return torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(shape)
        values = gguf.quants.dequantize(np.asarray(data), t.qtype)
    except NotImplementedError:
        raise CheckpointError(
            f"{where}: tensor '{t.name}' has GGUF type {t.type_name}, which cannot be decoded"
        ) from None
    except Exception as e:  # truncated data and the like
        raise CheckpointError(f"{where}: cannot read tensor '{t.name}' ({_why(e)})") from None
    out = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
    if out.numel() != int(np.prod(shape)):
        raise CheckpointError(
            f"{where}: tensor '{t.name}' holds {out.numel()} values, expected {list(shape)}"
        )
    return out.reshape(shape)


def raw_rows(t: GGUFTensor, where: Path, index: int | None = None) -> np.ndarray:
    """The stored bytes of `t` (or of ``t[index]``) as uint8 ``[rows, bytes per row]``."""
    data = _array(t, index)
    try:
        arr = np.ascontiguousarray(data).view(np.uint8)
    except Exception as e:
        raise CheckpointError(f"{where}: cannot read tensor '{t.name}' ({_why(e)})") from None
    return arr.reshape(-1, arr.shape[-1])


def _array(t: GGUFTensor, index: int | None) -> np.ndarray:
    """The data of `t` (or of ``t[index]``) as numpy, read from its file when it is a `FileSpan`."""
    if isinstance(t.data, FileSpan):
        return t.data.read(index)
    if index is not None and not 0 <= index < t.data.shape[0]:
        raise CheckpointError(f"{t.file}: tensor '{t.name}' has {t.data.shape[0]} slices, not {index + 1}")
    return t.data if index is None else t.data[index]


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."
