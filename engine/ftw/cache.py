"""The conversion cache: a Hugging Face folder that must be tiered is converted to FTW once.

Tier 2 and tier 3 hold expert *blocks* (FTW), so a checkpoint folder whose experts will not all
be resident is converted on its first tiered load, with a progress bar, into
``<cache>/<folder name>-<checkpoint key>-<quant>.ftw`` and used from there on every later load.

- Cache root: `cache_dir`, else ``$FREETOKEN_CACHE``, else the platform's user cache dir
  (`platformdirs.user_cache_dir("freetoken")`), under ``ftw/``.
- Key (`checkpoint_key`): sha256 over config.json, every tokenizer file the conversion embeds,
  and every ``*.safetensors`` file's name, size, modification time and header (tensor names,
  dtypes, shapes, offsets). A changed checkpoint gets a new entry; hashing all weight bytes is
  left to the engine's fingerprint (`anchors.digest.model_fingerprint`).
- Integrity: an entry appears atomically (the converter writes a temporary file and renames it),
  so a partial one never has the final name. Before first use every checksum of the entry is
  verified (`FTWFile.verify`) and a stamp (size, mtime, inode) is written beside it; a load
  whose entry no longer matches its stamp verifies it again. A corrupt entry is deleted and
  rebuilt. Blocks are also checked on every read, so damage after verification surfaces as
  FTWFormatError, never as wrong weights.
- Concurrency: conversions of one entry are serialised across processes by a file lock
  (`filelock`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import torch
from filelock import FileLock

from ..errors import FTWFormatError
from .convert import EMBEDDED_FILES, QUANTS, convert_checkpoint
from .reader import FTWFile

logger = logging.getLogger(__name__)

CACHE_ENV = "FREETOKEN_CACHE"
KEY_VERSION = b"freetoken-conversion-cache-v1"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where converted checkpoints live (see the module docstring)."""
    if cache_dir is not None:
        base = Path(cache_dir)
    elif os.environ.get(CACHE_ENV):
        base = Path(os.environ[CACHE_ENV])
    else:
        from platformdirs import user_cache_dir

        base = Path(user_cache_dir("freetoken"))
    return base.expanduser() / "ftw"


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (n,) = struct.unpack("<Q", head)
        return head + f.read(min(n, 100 * 2**20))


def checkpoint_key(folder: Path) -> str:
    """A short hex key of the checkpoint folder's identity (see the module docstring)."""
    h = hashlib.sha256(KEY_VERSION)
    for name in ("config.json", *EMBEDDED_FILES):
        path = folder / name
        if path.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    for path in sorted(folder.glob("*.safetensors")):
        st = path.stat()
        h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        h.update(hashlib.sha256(_safetensors_header(path)).digest())
    return h.hexdigest()[:20]


def lossless_quant(
    folder: Path, dtype: torch.dtype, source_dtype: torch.dtype | None
) -> tuple[str, torch.dtype]:
    """The codec (and dense dtype) that stores exactly the values the resident engine computes
    with: bf16 when the compute dtype or the experts' stored dtype is bfloat16, else fp32.
    Pre-quantized experts (gpt-oss MXFP4, DeepSeek-V3 fp8) keep their codec (carried over)."""
    config = json.loads((folder / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    dense = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    if method == "mxfp4":
        return "mxfp4", dense
    if method == "fp8":
        return "fp8", dense
    if dtype == torch.bfloat16 or source_dtype == torch.bfloat16:
        return "bf16", dense
    return "fp32", dense


def cached_ftw(
    folder: Path,
    *,
    quant: str,
    dense_dtype: torch.dtype,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """The verified FTW conversion of `folder` with expert codec `quant`, converting (and
    verifying) it first when the cache has no sound entry. ValueError for an unknown quant;
    the converter's CheckpointError / UnsupportedModelError for a bad folder."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; expected one of {', '.join(QUANTS)}")
    folder = Path(folder).resolve()
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    dense = str(dense_dtype).removeprefix("torch.")
    entry = root / f"{folder.name}-{checkpoint_key(folder)}-{quant}-{dense}.ftw"
    with FileLock(str(entry) + ".lock"):
        if entry.exists():
            try:
                _verify(entry, progress)
                logger.info("using the cached conversion %s", entry)
                return entry
            except FTWFormatError as e:
                logger.warning("cached conversion %s is damaged (%s); converting again", entry, e)
                _remove(entry)
        logger.info("converting %s to FTW (%s experts) into the cache: %s", folder, quant, entry)
        convert_checkpoint(folder, entry, quant=quant, dense_dtype=dense_dtype, progress=progress)
        _verify(entry, progress)
    return entry


def _stamp_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".verified")


def _identity(entry: Path) -> dict[str, int]:
    st = entry.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _verify(entry: Path, progress: bool) -> None:
    """Every checksum of `entry`, unless its stamp says this very file was verified already."""
    stamp = _stamp_path(entry)
    try:
        if json.loads(stamp.read_text()) == _identity(entry):
            return
    except (OSError, ValueError):
        pass
    with FTWFile(entry) as f:
        f.verify(progress=progress)
    stamp.write_text(json.dumps(_identity(entry)))


def _remove(entry: Path) -> None:
    for path in (entry, _stamp_path(entry)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass
