"""Crash-safe, private writes of a saved-anchor folder (the file formats are in `persist.py`).

A save is two files: the KV tensors and the JSON manifest that names them and authenticates them.
Replacing them one by one (as the first version did) leaves a folder whose manifest and KV file
come from different saves after a crash between the two renames, and the previous save is lost
too. Here a save is atomic as a whole:

1. the KV file gets a new name, `kv-<sha256 of its bytes>.safetensors`, so writing it never touches
   the file the current manifest names;
2. it is written to a private temporary file, fsync-ed and renamed to that name; the manifest is
   written the same way, then the folder is fsync-ed;
3. the manifest is renamed over `anchors.json`: the single step that switches from the previous
   save to the new one; the folder is fsync-ed again;
4. only then are KV files no manifest names (the previous save's) removed.

A crash (kill -9, power loss) at any point leaves `anchors.json` naming a complete save: the
previous one before step 3, the new one after. Leftovers of an interrupted save (temporary files,
an unnamed KV file) are never read and are removed by the next save, before it writes anything (so
a save that failed on a full disk does not keep the disk full). A save that fails with an OSError
(ENOSPC, EDQUOT, EIO, EACCES...) removes what it wrote and raises AnchorSaveError.

Saves into one folder hold an exclusive `flock` on `.lock` in it (another process could otherwise
delete the KV file a concurrent save is about to name); loads hold a shared one, so a save never
removes the KV file a load is about to read. `flock` locks are released by the kernel when a
process dies: a crash leaves no stale lock.

Privacy: the folder is created 0700 and every file 0600 at creation (`os.open`/`os.mkdir` modes,
then narrowed by the umask only), never chmod-ed afterwards, so there is no moment at which
another user can read token ids or KV data. An existing folder keeps its mode (it may be one the
user chose to share); its files are still 0600.

Reads (`read_regular`, `read_manifest`) take only regular files of a bounded size: a folder is
input that someone else may have changed, and `anchors.json` or a KV file replaced by a symbolic
link to `/dev/zero` would otherwise be read until MemoryError, a FIFO would block the reader
forever. Files are opened with O_NOFOLLOW | O_NONBLOCK (a symbolic link is refused, a FIFO does
not block the open), their type is checked with fstat on the opened descriptor (no window between
check and read), and a read stops one byte past its bound. The manifest may hold at most
`MAX_META_BYTES` (256 MiB, checked on save too, so every save loads back); a KV file at most the
size its authenticated manifest records.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import AnchorFileError, AnchorSaveError

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (one writer per folder is then the caller's job)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

META_FILE = "anchors.json"
LOCK_FILE = ".lock"
KV_NAME_PATTERN = r"^kv(-[0-9a-f]{64})?\.safetensors$"  # `kv.safetensors`: folders saved before this
_KV_NAME = re.compile(KV_NAME_PATTERN)
_TMP_NAME = re.compile(r"^\.?(anchors\.json|kv(-[0-9a-f]{64})?\.safetensors)(\.[0-9a-f]{16})?\.tmp$")
_CHUNK = 1 << 20  # bytes per os.write: a short write is continued, never taken as done
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO without a writer must not block
MAX_META_BYTES = 256 << 20  # the largest `anchors.json` saved or read (about 20M token ids)


def kv_file_name(sha256_hex: str) -> str:
    """The name of a KV file whose bytes have this sha256: a new save never overwrites the KV file
    of the save it replaces (an identical one is replaced by the same bytes)."""
    return f"kv-{sha256_hex}.safetensors"


def commit(folder: Path, kv_name: str, kv_data: bytes, meta_data: bytes) -> None:
    """Make `folder` hold exactly this save (the KV bytes under `kv_name` and the manifest), atomically
    as a whole (see the module docstring). AnchorSaveError on any OSError; the previous save is
    then still in place unless the message says the new one was switched to."""
    if not _KV_NAME.match(kv_name):
        raise ValueError(f"not a KV file name: {kv_name!r}")
    if len(meta_data) > MAX_META_BYTES:  # it could not be loaded back: refuse before writing anything
        raise AnchorSaveError(
            f"cannot save anchors to {folder}: the manifest would be {len(meta_data)} bytes, more than "
            f"the {MAX_META_BYTES} a load reads; save fewer or shorter anchors"
        )
    switched = False
    try:
        _make_private_dir(folder)
        with _lock(folder, exclusive=True, create=True):
            _collect(folder, _referenced(folder))  # an interrupted save's leftovers: free their space
            written: list[Path] = []
            try:
                kv_tmp = _write_private(folder, kv_name, kv_data, written)
                os.replace(kv_tmp, folder / kv_name)
                meta_tmp = _write_private(folder, META_FILE, meta_data, written)
                _fsync_dir(folder)  # the KV file's name is durable before the manifest can name it
                os.replace(meta_tmp, folder / META_FILE)
                switched = True
                _fsync_dir(folder)
            except BaseException:
                for tmp in written:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                with contextlib.suppress(OSError):
                    _collect(folder, _referenced(folder))  # a KV file renamed in, never named
                raise
            try:
                _collect(folder, {kv_name})  # the previous save's KV file, now that it is replaced
            except OSError as e:  # the save is complete; the next one retries
                log.warning("saved anchors to %s but could not remove the previous KV file: %s", folder, e)
    except OSError as e:
        raise _save_error(folder, e, switched) from e


def read_manifest(path: Path) -> bytes:
    """The bytes of the manifest at `path`: `read_regular` bounded by `MAX_META_BYTES`."""
    return read_regular(path, MAX_META_BYTES, "the largest anchors.json this engine reads")


def read_regular(path: Path, max_bytes: int, bound: str) -> bytes:
    """The bytes of the regular file at `path`, which may hold at most `max_bytes` (`bound` says
    what that limit is, for the message).

    Raises FileNotFoundError when it does not exist (the caller knows what that means), and
    AnchorFileError (one line) when it is a symbolic link, not a regular file (FIFO, device,
    directory, socket), larger than `max_bytes` or unreadable. Never blocks on a FIFO and never
    reads more than `max_bytes` + 1 bytes (see the module docstring)."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            msg = f"{path} is a symbolic link: saved anchor files are regular files; refused"
            raise AnchorFileError(msg) from None
        raise AnchorFileError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AnchorFileError(f"{path} is not a regular file ({_kind(st.st_mode)}): refused")
        if st.st_size > max_bytes:
            raise AnchorFileError(f"{path} is {st.st_size} bytes, more than {max_bytes} ({bound}): refused")
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, min(_CHUNK, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # it grew since fstat
                raise AnchorFileError(f"{path} grew past {max_bytes} bytes ({bound}) while read: refused")
        return b"".join(chunks)
    except OSError as e:
        raise AnchorFileError(f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"mode {stat.S_IFMT(mode):o}"


@contextlib.contextmanager
def reading(folder: Path) -> Iterator[None]:
    """Hold a shared lock on `folder` while reading a save from it, when it has a lock file (a folder
    saved before locking, or one this user may not lock, is read without)."""
    try:
        with _lock(folder, exclusive=False, create=False):
            yield
    except _NoLock:
        yield


class _NoLock(Exception):
    """The folder has no lock file that can be opened (only raised before the `yield`)."""


@contextlib.contextmanager
def _lock(folder: Path, *, exclusive: bool, create: bool) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    path = folder / LOCK_FILE
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
    else:
        try:  # O_NONBLOCK: a FIFO in place of the lock file must not block the load
            fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
        except OSError as e:
            raise _NoLock() from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _make_private_dir(folder: Path) -> None:
    """Create `folder` with mode 0700 (its parents as `mkdir -p` would), durably; keep an existing one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder)) from None
        return
    _fsync_dir(folder.parent)


def _write_private(folder: Path, name: str, data: bytes, written: list[Path]) -> Path:
    """Write `data` to a new 0600 temporary file in `folder` and fsync it; returns its path (also
    appended to `written` before anything is written, so a failure can remove it)."""
    tmp = folder / f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
    written.append(tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view[:_CHUNK]) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def _fsync_dir(folder: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # Windows: directories cannot be opened, renames are durable
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems (FUSE, CIFS) cannot fsync a directory: best effort there
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _referenced(folder: Path) -> set[str] | None:
    """The KV file names the manifest in `folder` names: empty when there is none, None when it
    cannot be read (then no KV file is removed: it may be a save worth recovering by hand)."""
    try:
        kv = json.loads(read_manifest(folder / META_FILE)).get("kv_file")
    except FileNotFoundError:
        return set()
    except (AnchorFileError, ValueError, AttributeError, RecursionError):
        return None
    return {kv} if isinstance(kv, str) and _KV_NAME.match(kv) else None


def _collect(folder: Path, keep: set[str] | None) -> None:
    """Remove this module's temporary files and the KV files not in `keep` (all kept when None)."""
    removed = False
    with os.scandir(folder) as entries:
        names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
    for name in names:
        if _TMP_NAME.match(name) or (keep is not None and _KV_NAME.match(name) and name not in keep):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / name)
            removed = True
    if removed:
        _fsync_dir(folder)


def _save_error(folder: Path, e: OSError, switched: bool) -> AnchorSaveError:
    cause = (e.strerror or str(e) or type(e).__name__).replace("\n", " ")
    code = errno.errorcode.get(e.errno or 0)
    state = (
        "the new save is in place but may not be durable"
        if switched
        else "the previous save there, if any, is unchanged"
    )
    return AnchorSaveError(f"cannot save anchors to {folder}: {cause}{f' [{code}]' if code else ''}; {state}")
