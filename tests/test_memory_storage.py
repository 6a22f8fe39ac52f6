"""Tier 3 (`BlockReader`): reads that leave the OS page cache alone (so tier 3 is really the disk),
verified blocks (a named FTWFormatError), and buffer recycling that never reuses a buffer still
in use."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from freetoken_agents.engine.errors import FTWFormatError
from freetoken_agents.engine.ftw import FTWFile, FTWWriter, encode
from freetoken_agents.engine.memory import BlockReader, new_block_buffer
from freetoken_agents.engine.memory.storage import LinkQueue
from freetoken_agents.engine.memory.weights import decode_block

PAGE = mmap.PAGESIZE


def _experts(n: int, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        e: {"gate_up": torch.randn(128, 96, generator=g), "down": torch.randn(96, 64, generator=g)}
        for e in range(n)
    }


def write_ftw(path: Path, experts: dict[int, dict[str, torch.Tensor]]) -> Path:
    with FTWWriter(path, model_config={"model_type": "mixtral"}) as w:
        for e, tensors in experts.items():
            w.add_expert(0, e, {k: encode(v, "fp32") for k, v in tensors.items()})
    fd = os.open(path, os.O_RDONLY)
    try:  # written pages are dirty: sync so that DONTNEED can drop them
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def cached_bytes(path: Path, start: int, length: int) -> int:
    """Bytes of [start, start + length) of `path` that sit in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: nothing is written
    try:
        buf = (ctypes.c_char * size).from_buffer(mm)
        try:
            first, last = start // PAGE, (start + length - 1) // PAGE
            vec = (ctypes.c_ubyte * (last - first + 1))()
            addr = ctypes.addressof(buf) + first * PAGE
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t((last - first + 1) * PAGE), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(v & 1 for v in vec) * PAGE
        finally:
            del buf
    finally:
        mm.close()


@pytest.fixture()
def ftw_path(tmp_path: Path) -> Path:
    return write_ftw(tmp_path / "m.ftw", _experts(4))


def _block_range(f: FTWFile) -> tuple[int, int]:
    """The file range of the expert blocks, dropped from the page cache (opening the file reads
    its header and manifest, and the kernel's readahead may bring in a few block pages)."""
    infos = [f.expert_info(*k) for k in f.expert_keys()]
    start = min(i.offset for i in infos)
    length = max(i.data_offset + i.stored_length for i in infos) - start
    fd = os.open(f.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return start, length


def test_direct_reads_leave_the_page_cache_alone_buffered_reads_fill_it(ftw_path):
    """The bug this fixes: blocks read with plain pread stayed in the page cache, an unbudgeted RAM
    tier that served later "disk" reads (bench/offload.py measured everyone at RAM speed)."""
    with FTWFile(ftw_path) as f:
        start, length = _block_range(f)
        before = cached_bytes(ftw_path, start, length)  # at most the page shared with the manifest
        assert before <= PAGE
        reader = BlockReader(f)
        assert reader.direct  # ext4 / xfs: O_DIRECT works
        want = _experts(4)
        for key in f.expert_keys():
            w = decode_block(f, key, reader.read(*key), torch.float32)
            assert torch.equal(w.gate_up, want[key[1]]["gate_up"])
            assert torch.equal(w.down, want[key[1]]["down"])
        assert cached_bytes(ftw_path, start, length) == before
        assert reader.bytes_read >= sum(f.expert_info(*k).block_length for k in f.expert_keys())
        assert reader.reads == 4 and reader.busy_seconds > 0
        for key in f.expert_keys():  # the old read path: every block lands in the page cache
            f.read_expert_bytes(*key)
        assert cached_bytes(ftw_path, start, length) >= length - PAGE
        reader.close()


def test_buffered_fallback_drops_what_it_read(ftw_path):
    with FTWFile(ftw_path) as f:
        start, length = _block_range(f)
        before = cached_bytes(ftw_path, start, length)
        reader = BlockReader(f, direct=False)
        assert not reader.direct
        for e in range(4):
            assert len(reader.read(0, e)) == f.expert_info(0, e).stored_length
        assert cached_bytes(ftw_path, start, length) <= before
        reader.close()


def test_buffered_fallback_leaves_no_readahead_behind(ftw_path):
    """The bug this fixes: a buffered read made the kernel read ahead past the block, and dropping
    the block's range left those pages cached (reading 30 blocks of 25 MB at random left 304 MB
    of the file in the page cache). POSIX_FADV_RANDOM turns readahead off for the reader's fd."""
    with FTWFile(ftw_path) as f:
        start, length = _block_range(f)
        before = cached_bytes(ftw_path, start, length)
        reader = BlockReader(f, direct=False)
        reader.read(0, 0)  # two blocks in file order: the kernel sees a sequential reader and
        reader.read(0, 1)  # reads ahead into blocks 2 and 3
        assert cached_bytes(ftw_path, start, length) <= before
        reader.close()


@pytest.mark.parametrize(
    "where, match",
    [
        ("data", r"expert block \(layer=0, expert=1\) at byte offset \d+: checksum mismatch"),
        ("header", r"expert block \(layer=0, expert=1\) at byte offset \d+: block header"),
    ],
)
def test_corrupted_block_is_named(ftw_path, where, match):
    with FTWFile(ftw_path) as f:
        info = f.expert_info(0, 1)
    with open(ftw_path, "r+b") as fh:
        fh.seek(info.data_offset + 100 if where == "data" else info.offset + 5)
        fh.write(b"\x13\x37")
    with FTWFile(ftw_path) as f, pytest.raises(FTWFormatError, match=match) as err:
        BlockReader(f).read(0, 1)
    assert str(ftw_path) in str(err.value)
    with FTWFile(ftw_path) as f:
        assert len(BlockReader(f).read(0, 2)) == info.stored_length  # other blocks still read


def test_truncated_file_is_named(ftw_path, tmp_path):
    with FTWFile(ftw_path) as f:
        info = f.expert_info(0, 3)
    cut = tmp_path / "cut.ftw"
    cut.write_bytes(ftw_path.read_bytes())
    with FTWFile(cut) as f:  # the manifest is read at open: cut the file after that
        os.truncate(cut, info.data_offset + 10)
        with pytest.raises(FTWFormatError, match=r"expert=3\) at byte offset \d+: file truncated"):
            BlockReader(f).read(0, 3)


def _mapping_field(buf: mmap.mmap, field: str) -> int:
    """`field` (kB) of the /proc/self/smaps entry of the mapping that holds `buf`."""
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))  # the ctypes object dies here
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= start < hi
            elif inside and head == f"{field}:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {start:#x}")


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def test_block_buffers_are_faulted_in_and_on_huge_pages_where_the_kernel_has_them():
    size = (8 << 20) + PAGE  # a block is rarely a whole number of huge pages
    buf = new_block_buffer(size)
    assert len(buf) == size and buf[0] == 0 and buf[size - 1] == 0
    buf[size - 1] = 7  # writable: O_DIRECT reads land in it
    assert buf[size - 1] == 7
    if not Path("/proc/self/smaps").exists():
        return  # not Linux: nothing more to check
    # Faulted in before any read (Rss covers it), so a read never waits on page faults.
    assert _mapping_field(buf, "Rss") * 1024 >= size
    if _thp_mode() in ("always", "madvise"):
        # 8 MiB at any alignment holds 3 whole 2 MiB pages (asking for one leaves the kernel room
        # to fail a compaction): O_DIRECT reads into 4 KiB pages make smaller requests and pin
        # 6,400 pages per 25 MB (bench/tier3_reads.py: 1.50 GB/s into scattered 4 KiB pages, 2.36
        # into huge pages).
        assert _mapping_field(buf, "AnonHugePages") >= 2048
    buf.close()


def test_buffers_are_reused_only_when_nothing_references_them(ftw_path):
    with FTWFile(ftw_path) as f:
        reader = BlockReader(f)
        a = reader.read(0, 0)
        view = decode_block(f, (0, 0), a, torch.float32).gate_up  # zero-copy into a's buffer
        before = view.clone()
        reader.buffers.retire(a)
        del a
        b = reader.read(0, 1)  # the retired buffer is still referenced by `view`: not reused
        assert reader.buffers.reused == 0 and torch.equal(view, before)
        del view
        reader.buffers.retire(b)
        del b
        c = reader.read(0, 2)  # now nothing refers to either: one of them is reused
        assert reader.buffers.reused == 1 and reader.buffers.allocated == 2
        w = decode_block(f, (0, 2), c, torch.float32)
        assert torch.equal(w.gate_up, _experts(4)[2]["gate_up"])
        reader.close()


def test_link_queue_serves_one_read_at_a_time_and_demand_first():
    """Two 25 MB reads in flight together delivered 20-30% less than back to back on this disk:
    one read at a time, and a waiting demand read goes before a waiting prefetch."""
    link, order, started = LinkQueue(), [], threading.Event()
    link.acquire(urgent=False)  # a prefetch read is on the link

    def reader(name: str, urgent: bool) -> None:
        if not urgent:
            started.set()
        link.acquire(urgent)
        order.append(name)
        link.release()

    prefetch = threading.Thread(target=reader, args=("prefetch", False))
    prefetch.start()
    assert started.wait(5)
    time.sleep(0.05)  # the prefetch is now waiting for the link
    demand = threading.Thread(target=reader, args=("demand", True))
    demand.start()
    time.sleep(0.05)
    assert order == []  # nobody shares the link
    link.release()
    prefetch.join(5)
    demand.join(5)
    assert order == ["demand", "prefetch"]


def test_a_prefetch_read_no_longer_wanted_when_the_link_frees_is_skipped(ftw_path):
    """With two loader threads a prefetch often waits for the link; if its prediction was dropped
    meanwhile, reading it would spend the link (the bottleneck) on nothing."""
    with FTWFile(ftw_path) as f:
        reader = BlockReader(f)
        asked = []
        assert reader.read(0, 1, urgent=False, still_wanted=lambda: asked.append(1) or False) is None
        assert asked == [1] and reader.reads == 0 and reader.bytes_read == 0
        assert len(reader.read(0, 1)) == f.expert_info(0, 1).stored_length  # the link was released
        reader.close()
