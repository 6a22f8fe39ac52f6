"""Tier 3: expert blocks read straight from the FTW file on disk, past the OS page cache.

`BlockReader.read(layer, expert)` reads one block (64-byte header + stored bytes) in one aligned
read into a page-aligned buffer (`BlockBuffers`: recycled when possible), checks the block header
against the manifest and the stored bytes against their xxhash64 (`FTWFile.check_block`, the
reader's own check), and returns the stored bytes as a memoryview over that buffer (zero-copy
tensors can be built on it: `FTWFile.decode_stored`).

Why past the page cache: otherwise the OS keeps every block read once and serves the next "disk"
read from RAM: an unbudgeted fourth tier that makes the byte budgets fiction and hides the disk.
FTW blocks start on 4 KiB boundaries, so a block is one O_DIRECT read. Where O_DIRECT is refused
(tmpfs, some network filesystems: EINVAL at open or at the first read) reads are buffered with the
kernel's readahead off and the range is dropped from the page cache right after
(`posix_fadvise(DONTNEED)`); `direct` says which.

Buffers: a fresh anonymous mapping costs the kernel a page fault and a zeroed page per 4 KiB and
an munmap when freed (measured ~20 ms per 25 MB block on this shared 2-core machine, a third of
the read itself). `BlockBuffers` recycles the buffer of a block the tiers dropped once nothing
references it any more: every user of a block's bytes (tier entries, tensors decoded zero-copy
from it, a prefetch result) holds a reference to its memoryview, so CPython's reference count of
that memoryview tells when it is free; a buffer still referenced is simply not reused.

Errors: FTWFormatError naming the file, the block and the byte offset for a truncated file, a
block header that disagrees with the manifest, or a checksum mismatch (a corrupted block).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable

from ..errors import FTWFormatError
from ..ftw import FTWFile
from ..ftw.layout import ALIGNMENT, BLOCK_HEADER_SIZE, align_up

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class BlockBuffers:
    """Page-aligned buffers for blocks; `retire` a dropped block's bytes, `acquire` reuses them.

    A retired memoryview is reused only when the retired list holds its last reference (no tier,
    tensor view or pending prefetch result refers to it). At most `max_retired` are kept.
    """

    def __init__(self, max_retired: int = 8) -> None:
        self.max_retired = max_retired
        self.allocated = 0
        self.reused = 0
        self._retired: list[memoryview] = []
        self._lock = threading.Lock()

    def retire(self, stored: memoryview) -> None:
        """`stored` (from `BlockReader.read`) left every tier; its buffer may be reused later."""
        if not isinstance(stored, memoryview) or not isinstance(stored.obj, mmap.mmap):
            return
        with self._lock:
            if any(r is stored for r in self._retired):
                return
            self._retired.append(stored)
            if len(self._retired) > self.max_retired:
                self._retired.pop(0)  # freed by the garbage collector once unreferenced

    def acquire(self, size: int) -> mmap.mmap:
        """A page-aligned buffer of `size` bytes: a free retired one, else a new mapping."""
        with self._lock:
            for i in range(len(self._retired)):
                # 2 = the list's reference + getrefcount's argument: nothing else holds it.
                if len(self._retired[i].obj) == size and sys.getrefcount(self._retired[i]) == 2:
                    stored = self._retired.pop(i)
                    buf = stored.obj
                    stored.release()
                    self.reused += 1
                    return buf  # type: ignore[return-value]
        self.allocated += 1
        return new_block_buffer(size)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module does not name it


def new_block_buffer(size: int) -> mmap.mmap:
    """A fresh buffer for O_DIRECT reads: anonymous (page-aligned), backed by transparent huge
    pages where the kernel grants them, its pages faulted in now.

    Huge pages: the kernel splits an O_DIRECT read where the buffer's physical pages stop being
    contiguous (a request holds a bounded number of contiguous runs) and pins, then dirties and
    unpins, every page. Over 4 KiB pages a request is only as large as free memory happens to be
    contiguous (measured here: 2.4-3.6 MB, less once a process has freed and reused memory) and a
    25 MB block is 6,400 pages; over 2 MiB pages requests reach the device's cap (4 MB) and a
    block is 13 pages. `bench/tier3_reads.py` on this project's virtual disk: 25 MB blocks read at
    1.50 GB/s into scattered 4 KiB pages, 2.36 into huge-page buffers. Before this, a second run
    of bench/offload.py's (a) in one process read ~25% slower than the first.
    Faulted in now: otherwise the read faults them in while it holds the link, and the link idles
    meanwhile.
    """
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not a POSIX system: a plain anonymous mapping
        return mmap.mmap(-1, size)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out or disabled: 4 KiB pages
            pass
    try:
        buf.madvise(_MADV_POPULATE_WRITE)
    except (OSError, AttributeError):  # older kernel (EINVAL) or no madvise: touch every page
        for i in range(0, size, mmap.PAGESIZE):
            buf[i] = 0
    return buf


class LinkQueue:
    """One read on the link at a time; a waiting urgent (demand) read goes before the others.

    Measured on this machine's virtual disk: two 25 MB O_DIRECT reads in flight together (the
    loader thread's prefetch and the compute thread's demand read) delivered 20-30% less than the
    same reads back to back (decode 4.5 -> 5.5 tok/s in bench/offload.py's setting).
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._busy = False
        self._urgent_waiting = 0

    def acquire(self, urgent: bool) -> None:
        with self._cv:
            self._urgent_waiting += urgent
            while self._busy or (not urgent and self._urgent_waiting):
                self._cv.wait()
            self._urgent_waiting -= urgent
            self._busy = True

    def release(self) -> None:
        with self._cv:
            self._busy = False
            self._cv.notify_all()


def _open_buffered(path: str | os.PathLike[str]) -> int:
    """A plain fd for buffered reads with the kernel's readahead off (POSIX_FADV_RANDOM): a read
    then caches only the block it asked for, which DONTNEED drops right after. With readahead,
    dropping the block's range left what was read past it cached: 30 random 25 MB blocks left
    304 MB of the file in the page cache (with it off: none)."""
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


class BlockReader:
    """Reads verified expert blocks of `ftw` from disk (O_DIRECT when `direct` and supported).

    `serial`: one read on the link at a time, demand reads first (`LinkQueue`). `on_transfer`
    (if set) gets (bytes, seconds) of every read's transfer alone (no queueing, no checksum).
    Attributes: `bytes_read` (bytes transferred from the file, aligned reads included), `reads`,
    `busy_seconds` (wall time with a read in flight: `bytes_read / busy_seconds` is what the link
    delivered while it had work, checksums and waits excluded), `direct` (True while O_DIRECT is
    in effect), `buffers` (the recycled buffers). Thread-safe.
    """

    def __init__(
        self,
        ftw: FTWFile,
        *,
        direct: bool = True,
        serial: bool = True,
        on_transfer: Callable[[int, float], None] | None = None,
    ) -> None:
        self.ftw = ftw
        self.buffers = BlockBuffers()
        self.link = LinkQueue() if serial else None
        self.on_transfer = on_transfer  # (bytes, seconds) per read
        self.path = ftw.path
        self.bytes_read = 0
        self.reads = 0
        self.busy_seconds = 0.0  # time with at least one read in flight (the link was in use)
        self._inflight, self._busy_since = 0, 0.0
        self._lock = threading.Lock()
        self.direct = bool(direct and _O_DIRECT)
        self._fd = -1
        if self.direct:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | _O_DIRECT)
            except OSError as e:
                logger.info("O_DIRECT refused for %s (%s): buffered reads + DONTNEED", self.path, e)
                self.direct = False
        if self._fd < 0:
            try:
                self._fd = _open_buffered(self.path)
            except OSError as e:
                raise FTWFormatError(f"{self.path}: cannot open FTW file: {e}") from e

    def _err(self, msg: str, key: tuple[int, int], offset: int) -> FTWFormatError:
        return FTWFormatError(
            f"{self.path}: expert block (layer={key[0]}, expert={key[1]}) at byte offset {offset}: {msg}"
        )

    def _busy(self, start: bool) -> None:
        with self._lock:
            now = time.perf_counter()
            if start:
                if self._inflight == 0:
                    self._busy_since = now
                self._inflight += 1
            else:
                self._inflight -= 1
                if self._inflight == 0:
                    self.busy_seconds += now - self._busy_since

    def _read_into(self, buf: mmap.mmap, offset: int, key: tuple[int, int]) -> int:
        """Fill `buf` from `offset`; returns the bytes read (short only at the end of the file)."""
        view = memoryview(buf)
        got = 0
        self._busy(True)
        try:
            while got < len(buf):
                n = os.preadv(self._fd, [view[got:]], offset + got)
                if n <= 0:
                    break
                got += n
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise self._err(f"read failed: {e}", key, offset + got) from e
            logger.info("O_DIRECT read refused for %s (%s): buffered reads + DONTNEED", self.path, e)
            with self._lock:
                if self.direct:
                    os.close(self._fd)
                    self._fd = _open_buffered(self.path)
                    self.direct = False
            return self._read_into(buf, offset, key)
        finally:
            self._busy(False)
            view.release()
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, offset, len(buf), os.POSIX_FADV_DONTNEED)
        return got

    def read(
        self,
        layer: int,
        expert: int,
        *,
        urgent: bool = True,
        still_wanted: Callable[[], bool] | None = None,
    ) -> memoryview | None:
        """The block's verified stored bytes (a memoryview over a page-aligned buffer it owns).
        `urgent`: a demand read (the compute thread waits for it); prefetches pass False and
        yield the link to it. `still_wanted` (prefetches): asked once the link is ours; when it
        says no the read is skipped and None returned (the prediction changed while it waited)."""
        info = self.ftw.expert_info(layer, expert)
        key = (layer, expert)
        if self._fd < 0:
            raise FTWFormatError(f"{self.path}: the block reader is closed")
        need = BLOCK_HEADER_SIZE + info.stored_length
        size = align_up(need, ALIGNMENT)
        buf = self.buffers.acquire(size)
        if self.link is not None:
            self.link.acquire(urgent)
        if still_wanted is not None and not still_wanted():
            if self.link is not None:
                self.link.release()
            self.buffers.retire(memoryview(buf))
            return None
        try:
            t0 = time.perf_counter()
            got = self._read_into(buf, info.offset, key)
            seconds = time.perf_counter() - t0
        finally:
            if self.link is not None:
                self.link.release()
        if self.on_transfer is not None:
            with self._lock:  # one caller at a time (the loader and the compute thread both read)
                self.on_transfer(got, seconds)
        with self._lock:
            self.bytes_read += got
            self.reads += 1
        if got < need:
            raise self._err(f"file truncated: wanted {need} bytes, got {got}", key, info.offset)
        stored = memoryview(buf)[BLOCK_HEADER_SIZE:need]
        self.ftw.check_block(info, memoryview(buf)[:BLOCK_HEADER_SIZE], stored)
        return stored

    def stats(self) -> dict[str, int | float | bool]:
        """Reads, bytes read, whether O_DIRECT is in use, and the seconds a read was in flight."""
        return {
            "reads": self.reads,
            "bytes_read": self.bytes_read,
            "direct_io": self.direct,
            "busy_s": self.busy_seconds,
        }

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except OSError:
            pass
