"""Saved anchors survive a crash at any point of a save: the folder then loads as the complete
previous save or the complete new one, never as an error, and the next save removes the leftovers.

Two ways to crash: in process, every file-system call of `save_anchors` from the k-th on fails with
a BaseException (nothing after it reaches the disk; a write at the crash is torn in half), for every
k; and a real `kill -9`: a forked child saves and sends itself SIGKILL at its step k."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from anchor_saves import anchors_of, loaded_ids

from freetoken_agents.engine import AnchorFileError, Engine
from freetoken_agents.engine.anchors.persist import load_anchors, save_anchors

pytestmark = pytest.mark.usefixtures("one_thread", "anchor_key")

STEPS = ("mkdir", "open", "write", "fsync", "replace", "rename", "unlink")  # what can change the disk
MAX_STEPS = 100  # far more than one save takes: a loop that never completes fails, not hangs


class Crash(BaseException):
    """The process died here: no handler may do anything about it."""


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint("qwen3_moe"))


@pytest.fixture
def two_saves(engine) -> Iterator[tuple[list, list]]:
    """(previous, new): the anchors of two different saves (the new one has one more anchor)."""
    made = anchors_of(engine, ((40, 1), (37, 2)))
    yield made[:1], made
    engine.anchors.clear()


def _clean(folder: Path) -> bool:
    """Only one complete save's files: the manifest, the KV file it names, the lock."""
    names = sorted(p.name for p in folder.iterdir())
    kv_file = json.loads((folder / "anchors.json").read_text())["kv_file"]
    return names == sorted([".lock", "anchors.json", kv_file])


def _dying_os(k: int, die: Callable[[str], None]) -> dict[str, Callable]:
    """Replacements for the `STEPS` functions of `os`: step k calls `die` (a write first writes half
    its bytes: a torn write); `os.close` is left alone, as the kernel closes a dead process's files."""
    count = [0]
    real = {name: getattr(os, name) for name in STEPS}

    def wrap(name: str) -> Callable:
        def step(*args, **kwargs):
            if count[0] >= k:
                if count[0] == k and name == "write":
                    real["write"](args[0], bytes(args[1])[: len(args[1]) // 2])
                count[0] += 1
                die(name)
            count[0] += 1
            return real[name](*args, **kwargs)

        return step

    return {name: wrap(name) for name in STEPS}


def test_a_crash_at_every_step_of_a_save_keeps_a_complete_save(engine, two_saves, tmp_path, monkeypatch):
    previous, new = two_saves
    before, after = {a.id for a in previous}, {a.id for a in new}
    seen, cleaned = [], []
    for k in range(MAX_STEPS):
        folder = tmp_path / f"crash{k}"
        save_anchors(engine.anchors.host, previous, folder, pinned=())

        def die(name: str) -> None:
            raise Crash(name)

        with monkeypatch.context() as m:
            for name, fn in _dying_os(k, die).items():
                m.setattr(os, name, fn)
            try:
                save_anchors(engine.anchors.host, new, folder, pinned=())
                crashed = False
            except Crash:
                crashed = True
        got = loaded_ids(engine, folder)  # never an error
        assert got in (before, after), f"crash at step {k}"
        seen.append(got == after)
        save_anchors(
            engine.anchors.host, new, folder, pinned=()
        )  # the next save succeeds and removes leftovers
        cleaned.append(_clean(folder) and loaded_ids(engine, folder) == after)
        if not crashed:
            break
    else:
        pytest.fail(f"the save did not complete within {MAX_STEPS} steps")
    # The switch happens at exactly one step: before it the previous save, after it the new one.
    assert seen == sorted(seen) and not seen[0] and seen[-1] and len(seen) > 5
    assert all(cleaned)


def test_a_crash_during_a_first_save_leaves_no_save_or_the_new_one(engine, two_saves, tmp_path, monkeypatch):
    _, new = two_saves
    for k in range(MAX_STEPS):
        folder = tmp_path / f"first{k}"

        def die(name: str) -> None:
            raise Crash(name)

        with monkeypatch.context() as m:
            for name, fn in _dying_os(k, die).items():
                m.setattr(os, name, fn)
            try:
                save_anchors(engine.anchors.host, new, folder, pinned=())
                break
            except Crash:
                pass
        if (folder / "anchors.json").exists():
            assert loaded_ids(engine, folder) == {a.id for a in new}
        else:  # no save was completed: a clear error, the same as for any folder without one
            with pytest.raises(AnchorFileError, match="not a saved anchor folder"):
                load_anchors(engine.anchors.host, folder)
    else:
        pytest.fail(f"the save did not complete within {MAX_STEPS} steps")


def _save_in_child_killed_at(k: int, engine: Engine, anchors: list, folder: Path) -> bool:
    """Run `save_anchors` in a forked child that sends itself SIGKILL at its step k; True when it was
    killed, False when the save completed first."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest

        def die(name: str) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        try:
            for name, fn in _dying_os(k, die).items():
                setattr(os, name, fn)
            save_anchors(engine.anchors.host, anchors, folder, pinned=())
            os._exit(0)
        except BaseException:
            os._exit(3)
    deadline = time.monotonic() + 300  # generous: only so that a stuck child fails the test, not hangs it
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the child saving with a kill at step {k} did not finish")
    code = os.waitstatus_to_exitcode(done[1])
    assert code in (0, -signal.SIGKILL), f"the child failed at step {k}: exit code {code}"
    return code == -signal.SIGKILL


def test_a_real_kill_9_during_a_save_keeps_a_complete_save(engine, two_saves, tmp_path):
    previous, new = two_saves
    before, after = {a.id for a in previous}, {a.id for a in new}
    template = tmp_path / "template"
    save_anchors(engine.anchors.host, previous, template, pinned=())
    seen = []
    for k in range(MAX_STEPS):
        folder = tmp_path / f"kill{k}"
        shutil.copytree(template, folder)
        killed = _save_in_child_killed_at(k, engine, new, folder)
        got = loaded_ids(engine, folder)
        assert got in (before, after), f"kill -9 at step {k}"
        seen.append(got == after)
        if not killed:
            assert _clean(folder)
            break
    else:
        pytest.fail(f"the save did not complete within {MAX_STEPS} steps")
    assert seen == sorted(seen) and not seen[0] and seen[-1] and len(seen) > 5
