"""Saving anchors on a full disk (or after any other OSError) raises AnchorSaveError naming the
folder and the cause, leaves no temporary file and keeps the previous save; saved anchors are
private (folder 0700, files 0600 from their creation); folders saved before the atomic layout
still load, and a save's leftovers never stop the next one."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator

import pytest
from anchor_saves import anchors_of, loaded_ids

from freetoken_agents.engine import AnchorError, AnchorSaveError, Engine, EngineError
from freetoken_agents.engine.anchors.persist import _key_id, _mac, save_anchors

pytestmark = pytest.mark.usefixtures("one_thread", "anchor_key")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint("qwen3_moe"))


@pytest.fixture
def two_saves(engine) -> Iterator[tuple[list, list]]:
    """(previous, new): the anchors of two different saves."""
    made = anchors_of(engine, ((40, 3), (37, 4)))
    yield made[:1], made[1:]
    engine.anchors.clear()


def _failing(real, code: int, calls: list[int]):
    def fail(*args, **kwargs):
        calls.append(1)
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize(
    ("call", "code"),
    [("write", errno.ENOSPC), ("write", errno.EDQUOT), ("fsync", errno.ENOSPC), ("replace", errno.EIO)],
)
def test_a_full_disk_is_a_named_error_that_leaves_no_temp_file(
    engine, two_saves, tmp_path, monkeypatch, call, code
):
    previous, new = two_saves
    folder = tmp_path / "anchors"
    save_anchors(engine.anchors.host, previous, folder, pinned=())
    before = sorted(p.name for p in folder.iterdir())
    calls: list[int] = []
    with monkeypatch.context() as m:
        m.setattr(os, call, _failing(getattr(os, call), code, calls))
        with pytest.raises(AnchorSaveError) as info:
            save_anchors(engine.anchors.host, new, folder, pinned=())
    assert calls, "the save never reached the failing call"
    message = str(info.value)
    assert "\n" not in message and str(folder) in message and os.strerror(code) in message
    assert f"[{errno.errorcode[code]}]" in message and "previous save there, if any, is unchanged" in message
    assert isinstance(info.value, AnchorError) and isinstance(info.value, EngineError)
    assert sorted(p.name for p in folder.iterdir()) == before  # no temp file, no new KV file
    assert loaded_ids(engine, folder) == {a.id for a in previous}
    save_anchors(engine.anchors.host, new, folder, pinned=())  # space is back: the next save works
    assert loaded_ids(engine, folder) == {a.id for a in new}


def test_a_save_that_cannot_create_its_folder_is_a_named_error(engine, two_saves, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(AnchorSaveError, match="cannot save anchors to .*file.*Not a directory"):
        save_anchors(engine.anchors.host, two_saves[1], tmp_path / "file", pinned=())
    with pytest.raises(AnchorSaveError, match="cannot save anchors to .*sub: File exists"):
        save_anchors(engine.anchors.host, two_saves[1], tmp_path / "file" / "sub", pinned=())


def test_leftovers_of_an_interrupted_save_are_ignored_then_removed(engine, two_saves, tmp_path):
    previous, new = two_saves
    folder = tmp_path / "anchors"
    save_anchors(engine.anchors.host, previous, folder, pinned=())
    kept = sorted(p.name for p in folder.iterdir())
    junk = [
        "kv.safetensors.tmp",  # the names the first version left on a full disk
        "anchors.json.tmp",
        f".anchors.json.{'0' * 16}.tmp",
        f"kv-{'1' * 64}.safetensors",  # a KV file renamed in, never named by a manifest
        f".kv-{'2' * 64}.safetensors.{'3' * 16}.tmp",
    ]
    for name in junk:
        (folder / name).write_bytes(b"\0" * 4096)
    (folder / "notes.txt").write_text("the user's own file")
    assert loaded_ids(engine, folder) == {a.id for a in previous}  # never read
    save_anchors(engine.anchors.host, new, folder, pinned=())
    left = {p.name for p in folder.iterdir()}
    assert not left & set(junk) and "notes.txt" in left and len(left) == len(kept) + 1
    assert loaded_ids(engine, folder) == {a.id for a in new}


def test_saved_anchors_are_private_from_their_creation(engine, two_saves, tmp_path, monkeypatch):
    previous, new = two_saves
    folder = tmp_path / "deep" / "anchors"
    modes: list[int] = []
    real_write = os.write

    def write(fd, data):  # the mode of every file while anything is written to it
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_write(fd, data)

    def no_chmod(*args, **kwargs):
        raise AssertionError("modes are set at creation, not by chmod afterwards")

    old_umask = os.umask(0)  # the modes below then come from the creating calls alone
    try:
        with monkeypatch.context() as m:
            m.setattr(os, "write", write)
            for name in ("chmod", "fchmod", "lchmod"):
                if hasattr(os, name):
                    m.setattr(os, name, no_chmod)
            save_anchors(engine.anchors.host, previous, folder, pinned=())
            save_anchors(engine.anchors.host, new, folder, pinned=())  # replacing a save keeps the modes
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = list(folder.iterdir())
    assert len(files) == 3 and all(stat.S_IMODE(p.lstat().st_mode) == 0o600 for p in files)
    assert modes and set(modes) == {0o600}
    assert loaded_ids(engine, folder) == {a.id for a in new}


def test_a_folder_saved_before_the_atomic_layout_still_loads_and_is_migrated(
    engine, two_saves, tmp_path, anchor_key
):
    previous, new = two_saves
    folder = tmp_path / "old"
    save_anchors(engine.anchors.host, previous, folder, pinned=())
    doc = json.loads((folder / "anchors.json").read_text())
    (folder / doc["kv_file"]).rename(folder / "kv.safetensors")  # the first version's layout
    (folder / ".lock").unlink()
    doc["kv_file"] = "kv.safetensors"
    key = bytes.fromhex(anchor_key.read_text().strip())
    doc["mac"] = {"alg": "hmac-sha256", "key_id": _key_id(key), "value": _mac(key, doc)}
    (folder / "anchors.json").write_text(json.dumps(doc))
    assert loaded_ids(engine, folder) == {a.id for a in previous}
    save_anchors(engine.anchors.host, new, folder, pinned=())
    assert not (folder / "kv.safetensors").exists()
    assert loaded_ids(engine, folder) == {a.id for a in new}
