"""The conversion cache: a Hugging Face folder that must be tiered is converted to FTW once.

Tier 2 and tier 3 hold expert *blocks* (FTW), so a checkpoint folder whose experts will not all
be resident is converted on its first tiered load, with a progress bar, into
``<cache>/<folder name>-<checkpoint key>-<quant>.ftw`` and used from there on every later load.

- Cache root: `cache_dir`, else ``$FREETOKEN_CACHE``, else the platform's user cache dir
  (`platformdirs.user_cache_dir("freetoken")`), under ``ftw/``.
- Key (`checkpoint_key`): sha256 over config.json, every tokenizer file the conversion embeds,
  and every ``*.safetensors`` file's name, size and header (tensor names, dtypes, shapes,
  offsets). Weight bytes are not in the key (a touch must not orphan a 60 GB entry): they are
  checked on every load against the entry's source record (below).
- Integrity: an entry appears atomically (the converter writes a temporary file and renames it),
  so a partial one never has the final name (and the ``.tmp`` of a conversion that died is
  deleted by the next load, `_sweep_partial`). Before first use every checksum of the entry is
  verified (`FTWFile.verify`) and a stamp (size, mtime, inode) is written beside it; a load
  whose entry no longer matches its stamp verifies it again. A corrupt entry is deleted and
  rebuilt. Blocks are also checked on every read, so damage after verification surfaces as
  FTWFormatError, never as wrong weights.
- Source check (stale experts are never served): with each entry a record ``<entry>.source``
  holds, per ``*.safetensors`` file it was built from, the file's size, mtime_ns, ctime_ns,
  inode, header sha256 and an xxh3_128 hash of every byte (taken before converting, and the
  conversion is discarded if any file's identity moved while it ran). On load, when every
  file's (size, mtime_ns, ctime_ns, inode, header) matches, the recorded content is trusted;
  otherwise the files are hashed again and the entry is rebuilt if any byte differs (the
  record is refreshed when only metadata moved). An entry without a record (older versions)
  is rebuilt, never served blindly. Guarantee: any change through the file system updates
  ctime (every write does, and cp -p / rsync -t / a restore cannot set it back), so it is
  detected; a changed byte under an identical ctime needs root-level clock or disk tampering,
  which is not covered here (the engine fingerprint hashes the files it serves regardless).
- Concurrency: conversions of one entry are serialised across processes by a file lock
  (`filelock`).
- GGUF sources (`Engine.from_pretrained("x.gguf")`): the same cache, keyed on the GGUF file(s)
  (name, size, the first MiB: magic, metadata and tensor directory) and the quant (``"source"``,
  the default, keeps each expert weight's precision class, `gguf.convert`); the source record and
  its checks cover every part of a split GGUF in place of the ``*.safetensors`` files, and the
  entry is built by `gguf.convert_gguf`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import torch
import xxhash
from filelock import FileLock, Timeout

from ..checkpoint import read_config
from ..errors import FTWFormatError
from ..ftw.reader import FTWFile
from .calibrate import OpenForCalibration
from .convert import EMBEDDED_FILES, QUANTS, convert_checkpoint

logger = logging.getLogger(__name__)

CACHE_ENV = "FREETOKEN_CACHE"
KEY_VERSION = b"freetoken-conversion-cache-v3"  # v2: no mtime in the key; content checked per load;
# v3: the embedded files in name order (reordering `tokenizer_files.TOKENIZER_FILES` keeps keys)


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


def _weight_files(source: Path) -> list[Path]:
    """The files a conversion reads weights from: the GGUF parts, or the folder's safetensors."""
    if source.is_file():
        from .gguf.reader import gguf_parts

        return gguf_parts(source)
    return sorted(source.glob("*.safetensors"))


def _file_head(path: Path) -> bytes:
    """What identifies a weights file cheaply: a safetensors header, or a GGUF file's first MiB."""
    if path.suffix.lower() == ".gguf":
        with open(path, "rb") as f:
            return f.read(2**20)
    return _safetensors_header(path)


def checkpoint_key(folder: Path) -> str:
    """A short hex key of the checkpoint folder's (or GGUF file's) identity (see the module docstring)."""
    h = hashlib.sha256(KEY_VERSION)
    if folder.is_file():
        for path in _weight_files(folder):
            h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
            h.update(hashlib.sha256(_file_head(path)).digest())
        return h.hexdigest()[:20]
    for name in ("config.json", *sorted(EMBEDDED_FILES)):
        path = folder / name
        if path.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    for path in sorted(folder.glob("*.safetensors")):
        st = path.stat()
        h.update(f"{path.name}\0{st.st_size}\0".encode())
        h.update(hashlib.sha256(_safetensors_header(path)).digest())
    return h.hexdigest()[:20]


def lossless_quant(
    folder: Path, dtype: torch.dtype, source_dtype: torch.dtype | None
) -> tuple[str, torch.dtype]:
    """The codec (and dense dtype) that stores exactly the values the resident engine computes
    with: bf16 when the compute dtype or the experts' stored dtype is bfloat16, else fp32.
    Pre-quantized experts (gpt-oss MXFP4, DeepSeek-V3 fp8) keep their codec (carried over)."""
    config = read_config(folder)
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
    dense_dtype: torch.dtype | None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    open_model: OpenForCalibration | None = None,
) -> Path:
    """The verified FTW conversion of `folder` with expert codec `quant`, converting (and
    verifying) it first when the cache has no sound entry (`open_model`: for quant "auto", see
    `convert_checkpoint`). `folder` may be a GGUF file (quant
    "source" or a `QUANT_CODECS` name). ValueError for an unknown quant; the converter's
    CheckpointError / UnsupportedModelError for a bad folder or file."""
    folder = Path(folder).resolve()
    gguf = folder.is_file()
    if gguf:
        from .gguf.convert import GGUF_QUANTS

        if quant not in GGUF_QUANTS:
            raise ValueError(
                f"unknown quant {quant!r} for a GGUF file; expected one of {', '.join(GGUF_QUANTS)}"
            )
    elif quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; expected one of {', '.join(QUANTS)}")
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    _sweep_partial(root)
    dense = "source" if dense_dtype is None else str(dense_dtype).removeprefix("torch.")
    entry = root / f"{_source_name(folder)}-{checkpoint_key(folder)}-{quant}-{dense}.ftw"
    with FileLock(str(entry) + ".lock"):
        if entry.exists() and not _source_current(entry, folder):
            logger.warning("cached conversion %s is stale (other checkpoint bytes); converting again", entry)
            _remove(entry)
        if entry.exists():
            try:
                _verify(entry, progress)
                logger.info("using the cached conversion %s", entry)
                return entry
            except FTWFormatError as e:
                logger.warning("cached conversion %s is damaged (%s); converting again", entry, e)
                _remove(entry)
        logger.info("converting %s to FTW (%s experts) into the cache: %s", folder, quant, entry)
        _remove(entry)
        record = _source_record(folder, with_content=True)
        if gguf:
            from .gguf.convert import convert_gguf

            convert_gguf(folder, entry, quant=quant, dense_dtype=dense_dtype, progress=progress)
        else:
            convert_checkpoint(
                folder, entry, quant=quant, dense_dtype=dense_dtype, progress=progress, open_model=open_model
            )
        if _identities(_source_record(folder, with_content=False)) != _identities(record):
            _remove(entry)
            raise FTWFormatError(f"{folder} changed while it was converted; load it again")
        _verify(entry, progress)
        _record_path(entry).write_text(json.dumps(record, sort_keys=True))
    return entry


def _sweep_partial(root: Path) -> None:
    """Delete the temporary files of conversions that died (killed, out of memory, a crash): a
    ``.ftw.tmp`` whose entry lock is free has no writer left. A failed conversion removes its own;
    lock files stay (unlinking a lock another process waits on would let two writers in)."""
    for tmp in root.glob("*.ftw.tmp"):
        try:
            with FileLock(str(tmp.with_suffix("")) + ".lock", timeout=0):
                tmp.unlink(missing_ok=True)
            logger.info("removed %s, left by a conversion that did not finish", tmp)
        except Timeout:
            continue  # a conversion is writing it right now
        except OSError as e:
            logger.warning("cannot remove the partial conversion %s (%s)", tmp, e)


def _source_name(source: Path) -> str:
    """How an entry names its source: the folder's or file's name, or for a huggingface_hub
    snapshot (``models--org--name/snapshots/<commit>``) the repo's, not the commit hash."""
    snapshots = source.parent
    if source.is_dir() and snapshots.name == "snapshots" and snapshots.parent.name.startswith("models--"):
        return snapshots.parent.name.removeprefix("models--")
    return source.name


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


def _record_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".source")


def _content_hash(path: Path) -> str:
    """xxh3_128 of every byte of `path` (streamed; many GB/s, so a rebuild check stays cheap)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def _source_record(folder: Path, *, with_content: bool) -> dict[str, dict[str, object]]:
    """Per weights file: identity (size, mtime, ctime, inode, header hash) and, if asked, content."""
    record: dict[str, dict[str, object]] = {}
    for path in _weight_files(folder):
        st = path.stat()
        item: dict[str, object] = {
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino,
            "header": hashlib.sha256(_file_head(path)).hexdigest(),
        }
        if with_content:
            item["xxh3_128"] = _content_hash(path)
        record[path.name] = item
    return record


def _identities(record: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    return {name: {k: v for k, v in item.items() if k != "xxh3_128"} for name, item in record.items()}


def _source_current(entry: Path, folder: Path) -> bool:
    """Whether `entry` was built from the bytes now in `folder` (see the module docstring)."""
    try:
        recorded = json.loads(_record_path(entry).read_text())
    except (OSError, ValueError):
        logger.warning("cached conversion %s has no source record; rebuilding it", entry)
        return False
    now = _source_record(folder, with_content=False)
    if not isinstance(recorded, dict) or set(recorded) != set(now):
        return False
    if _identities(recorded) == now:
        return True  # ctime unchanged: no write reached any file since it was hashed
    fresh = _source_record(folder, with_content=True)
    if {n: i.get("xxh3_128") for n, i in recorded.items()} != {n: i["xxh3_128"] for n, i in fresh.items()}:
        return False
    _record_path(entry).write_text(json.dumps(fresh, sort_keys=True))  # same bytes, new metadata
    return True


def _remove(entry: Path) -> None:
    for path in (entry, _stamp_path(entry), _record_path(entry)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass
