"""A saved-anchor folder is input someone else may have changed: `anchors.json`, a KV file, the lock
or the key replaced by a symbolic link to /dev/zero, a FIFO or an oversized file is refused with
one AnchorFileError (AnchorError for the key) line; nothing reads until MemoryError or blocks."""

from __future__ import annotations

import contextlib
import os
import resource
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from anchor_saves import anchors_of, loaded_ids

from freetoken_agents.engine import AnchorError, AnchorFileError, AnchorSaveError, Engine
from freetoken_agents.engine.anchors import savefolder
from freetoken_agents.engine.anchors.persist import load_anchors, save_anchors

pytestmark = [
    pytest.mark.usefixtures("one_thread", "anchor_key"),
    pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs and /dev/zero are POSIX"),
]

SAFETY_S = 60  # only against a hang: no assertion depends on how fast anything runs


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint("qwen3_moe"))


@pytest.fixture
def saved(engine, tmp_path) -> Iterator[Path]:
    """A folder holding one valid save."""
    folder = tmp_path / "anchors"
    save_anchors(engine.anchors.host, anchors_of(engine, ((40, 3),)), folder, pinned=())
    yield folder
    engine.anchors.clear()


@contextlib.contextmanager
def memory_cap(extra: int = 2 << 30) -> Iterator[None]:
    """A regression must end in MemoryError, not in the machine's memory: cap how much this
    process's address space may grow while the body runs (Linux: /proc/self/statm)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        cap = int(f.read().split()[0]) * resource.getpagesize() + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_unblocked(fn: Callable[[], Any], fifo: Path) -> tuple[dict[str, Any], bool]:
    """({"value": ...} or {"error": ...}, whether `fn` was found blocked opening `fifo` for reading).

    Opening a FIFO for writing without blocking succeeds only while a reader has it open: that is
    how a blocked reader is told from one that never waited; the open then also releases it."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(SAFETY_S)
    blocked = False
    if stat.S_ISFIFO(os.lstat(fifo).st_mode):  # else replaced (by a save): nobody can wait on it
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader waits on it
            pass
        else:
            blocked = True
            os.close(fd)
    thread.join(SAFETY_S)
    assert not thread.is_alive()
    return box, blocked


def kv_file(folder: Path) -> Path:
    (kv,) = folder.glob("kv-*.safetensors")
    return kv


def replace_with_link(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


@pytest.mark.parametrize("which", ["anchors.json", "kv"])
def test_a_link_to_dev_zero_is_refused_not_read(engine, saved, which):
    path = saved / "anchors.json" if which == "anchors.json" else kv_file(saved)
    replace_with_link(path, "/dev/zero")
    with memory_cap(), pytest.raises(AnchorFileError, match="symbolic link") as info:
        load_anchors(engine.anchors.host, saved)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("which", ["anchors.json", "kv"])
def test_a_fifo_is_refused_without_blocking(engine, saved, which):
    path = saved / "anchors.json" if which == "anchors.json" else kv_file(saved)
    replace_with_fifo(path)
    box, blocked = run_unblocked(lambda: load_anchors(engine.anchors.host, saved), path)
    assert not blocked, "the load blocked opening the FIFO"
    assert isinstance(box.get("error"), AnchorFileError), box
    assert "not a regular file (a FIFO)" in str(box["error"])


def test_a_fifo_lock_file_does_not_block_the_load(engine, saved):
    expected = loaded_ids(engine, saved)
    replace_with_fifo(saved / ".lock")
    box, blocked = run_unblocked(lambda: loaded_ids(engine, saved), saved / ".lock")
    assert not blocked, "the load blocked opening the lock FIFO"
    assert box.get("value") == expected, box


def test_a_fifo_key_file_is_refused_without_blocking(engine, saved, anchor_key):
    replace_with_fifo(anchor_key)
    box, blocked = run_unblocked(lambda: load_anchors(engine.anchors.host, saved), anchor_key)
    assert not blocked, "the load blocked opening the key FIFO"
    assert isinstance(box.get("error"), AnchorError), box
    assert "not a regular file" in str(box["error"])


def test_an_oversized_manifest_is_refused_unread(engine, saved):
    with open(saved / "anchors.json", "r+b") as f:
        f.truncate(savefolder.MAX_META_BYTES + 1)  # sparse: no disk space used
    with memory_cap(), pytest.raises(AnchorFileError, match=f"more than {savefolder.MAX_META_BYTES}"):
        load_anchors(engine.anchors.host, saved)


@pytest.mark.parametrize("grow", [1, 64 << 30])
def test_a_kv_file_longer_than_its_manifest_says_is_refused_unread(engine, saved, grow):
    kv = kv_file(saved)
    size = kv.stat().st_size
    with open(kv, "r+b") as f:
        f.truncate(size + grow)  # sparse
    with memory_cap(), pytest.raises(AnchorFileError, match=f"more than {size} \\(the size its authentic"):
        load_anchors(engine.anchors.host, saved)


@pytest.mark.parametrize("hostile", ["link to /dev/zero", "fifo"])
def test_a_save_replaces_a_hostile_manifest_without_reading_it(engine, saved, hostile):
    expected = loaded_ids(engine, saved)
    meta = saved / "anchors.json"
    if hostile == "fifo":
        replace_with_fifo(meta)
    else:
        replace_with_link(meta, "/dev/zero")
    anchors = anchors_of(engine, ((40, 3),))  # the same anchor again
    host = engine.anchors.host
    with memory_cap():
        box, blocked = run_unblocked(lambda: save_anchors(host, anchors, saved, pinned=()), meta)
    assert not blocked and box.get("value") == saved, box
    assert meta.is_file() and not meta.is_symlink()
    assert loaded_ids(engine, saved) == expected


def test_a_save_refuses_a_manifest_no_load_would_read(engine, saved, monkeypatch):
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    monkeypatch.setattr(savefolder, "MAX_META_BYTES", 1000)
    anchors = anchors_of(engine, ((37, 4),))
    with pytest.raises(AnchorSaveError, match="more than the 1000 a load reads"):
        save_anchors(engine.anchors.host, anchors, saved, pinned=())
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before
