"""Digests of weight files for the model fingerprint: every byte, hashed once per file version.

`weights_digest(path)` is a sha256 tree over the whole file: the sha256 of each `CHUNK_BYTES`
piece (hashed in parallel threads; hashlib releases the GIL), then
`sha256("freetoken-weights-v1\\0" || le64(size) || le64(CHUNK_BYTES) || leaf digests)`. Any change
of any byte changes it; forging a file with the same digest means breaking sha256.

Hashed once: results are cached by (real path, device, inode, size, mtime, ctime), in this process
and, for files of `PERSIST_MIN_BYTES` or more, in `fingerprints.json` in the FTW cache folder
(`ftw.cache.cache_root()`: `ftw/` under $FREETOKEN_CACHE, else under the user cache dir), so a
large model is read whole once, not at every start. ctime is in the key because no one can set it
back: rewriting a file and restoring its mtime still changes the key; so does replacing it (a new
inode).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CheckpointError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20
PERSIST_MIN_BYTES = 256 << 20
CACHE_FILE = "fingerprints.json"
_MAX_CACHED = 1024
_memory: dict[str, str] = {}
_lock = threading.Lock()


def _le64(n: int) -> bytes:
    return int(n).to_bytes(8, "little", signed=True)


def _key(path: str, st: os.stat_result) -> str:
    return f"{path}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def weights_digest(path: str | os.PathLike[str], fd: int | None = None) -> str:
    """sha256-tree hex digest of every byte of the file at `path` (see the module docstring).

    `fd`: an open descriptor of that file to read instead of opening `path` (hash exactly what the
    engine reads, even if `path` has been replaced since). CheckpointError when the file cannot be
    read or changes while it is hashed."""
    real = os.path.realpath(path)
    try:
        own = fd is None
        fd = os.open(real, os.O_RDONLY) if fd is None else fd
    except OSError as e:
        raise CheckpointError(f"cannot read {path} to fingerprint it: {e}") from e
    try:
        before = os.fstat(fd)
        key = _key(real, before)
        with _lock:
            cached = _memory.get(key)
        if cached is None and before.st_size >= PERSIST_MIN_BYTES:
            cached = _load_persisted().get(key)
        if cached is not None:
            return cached
        digest = _hash_fd(fd, before.st_size, path)
        after = os.fstat(fd)
    finally:
        if own:
            os.close(fd)
    if _key(real, after) != key:
        raise CheckpointError(f"{path} changed while it was being fingerprinted; load it again")
    with _lock:
        _memory[key] = digest
    if before.st_size >= PERSIST_MIN_BYTES:
        _persist(key, digest)
    return digest


def _hash_fd(fd: int, size: int, path: str | os.PathLike[str]) -> str:
    def leaf(offset: int) -> bytes:
        n = min(CHUNK_BYTES, size - offset)
        data = os.pread(fd, n, offset)
        while len(data) < n:
            more = os.pread(fd, n - len(data), offset + len(data))
            if not more:
                raise CheckpointError(
                    f"{path} is shorter than its size ({size} bytes) while fingerprinting it"
                )
            data += more
        return hashlib.sha256(data).digest()

    offsets = range(0, size, CHUNK_BYTES)
    workers = max(1, min(len(offsets), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers, thread_name_prefix="freetoken-fingerprint") as pool:
        leaves = b"".join(pool.map(leaf, offsets))
    root = hashlib.sha256(b"freetoken-weights-v1\0" + _le64(size) + _le64(CHUNK_BYTES))
    root.update(leaves)
    logger.debug("fingerprinted %s: %d bytes, %d chunks", path, size, len(offsets))
    return root.hexdigest()


def _cache_path() -> Path:
    from .cache import cache_root

    return cache_root() / CACHE_FILE


def _load_persisted() -> dict[str, str]:
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return (
        {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(data, dict)
        else {}
    )


def _persist(key: str, digest: str) -> None:
    """Add one entry to the on-disk cache (best effort: a failure only costs a rehash next time)."""
    path = _cache_path()
    try:
        entries = {k: v for k, v in _load_persisted().items() if os.path.exists(k.rsplit("|", 5)[0])}
        entries.pop(key, None)  # (entries of files gone since are dropped: temporary models)
        entries[key] = digest
        entries = dict(list(entries.items())[-_MAX_CACHED:])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=0))
        os.replace(tmp, path)
    except OSError as e:
        logger.info("could not record the fingerprint of a weights file in %s: %s", path, e)


def clear_memory_cache() -> None:
    """Forget this process's cached digests (tests; the persisted ones stay)."""
    with _lock:
        _memory.clear()
