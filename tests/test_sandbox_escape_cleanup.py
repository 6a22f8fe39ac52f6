"""The process level's cleanup against a directory swapped for a symlink while it runs.

Another run's uid owns a world-writable directory in /tmp, our run's uid left a file in it, and
between the cleanup's ownership check and its unlink the other run renames its directory away and
puts a symlink to a host directory in its place. The swap is made deterministic by doing it inside
the cleanup's first unlink (no timing involved)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from freetoken_agents.recipes import _sandbox_isolation as isolation

NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="files owned by other uids need root (chown)")
OURS, THEIRS = 1_500_000_001, 1_500_000_002  # the run being cleaned, a concurrent hostile run


def _shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    theirs = shared / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    os.chown(theirs, THEIRS, THEIRS)
    victim = tmp_path / "host"  # root-owned files elsewhere, same names as what the run left
    victim.mkdir()
    monkeypatch.setattr(isolation, "SHARED_TEMP_DIRS", (str(shared),))
    return shared, theirs, victim


def _swap_at(monkeypatch: pytest.MonkeyPatch, funcs: tuple[str, ...], leaf: str, theirs: Path, victim: Path):
    """Wrap the os functions `funcs` so the first call on a name ending in `leaf` first swaps
    `theirs` for a symlink to `victim`: the moment between the cleanup's check and its action."""
    calls: list[str] = []

    def wrap(real):
        def swapping(*args, **kwargs):
            target = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
            if not calls and (target == leaf or target.endswith("/" + leaf)):
                theirs.rename(theirs.with_name("theirs.moved"))
                theirs.symlink_to(victim)
                calls.append(target)
            return real(*args, **kwargs)

        return swapping

    for name in funcs:
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))
    return calls


@NEEDS_ROOT
def test_a_directory_swapped_for_a_symlink_between_check_and_unlink_deletes_nothing_outside(
    tmp_path, monkeypatch
):
    shared, theirs, victim = _shared(tmp_path, monkeypatch)
    for i in range(20):
        (victim / f"f{i}").write_text("host data")
        left = theirs / f"f{i}"
        left.write_text("left by the run")
        os.chown(left, OURS, OURS)
    calls = _swap_at(monkeypatch, ("unlink",), "f0", theirs, victim)
    removed = isolation._remove_files(OURS)
    monkeypatch.undo()
    assert calls, "the cleanup never unlinked anything"
    assert sorted(p.name for p in victim.iterdir()) == sorted(f"f{i}" for i in range(20))
    assert all(p.read_text() == "host data" for p in victim.iterdir())
    # what the run left went with the directory it was in, and was removed there
    assert removed == 20
    assert list((shared / "theirs.moved").iterdir()) == []


@NEEDS_ROOT
def test_a_swap_while_removing_an_owned_tree_deletes_nothing_outside(tmp_path, monkeypatch):
    shared, theirs, victim = _shared(tmp_path, monkeypatch)
    (victim / "d").mkdir()
    (victim / "d" / "keep").write_text("host data")
    tree = theirs / "d"  # a directory the run made inside the other run's directory
    tree.mkdir()
    (tree / "keep").write_text("left by the run")
    for p in (tree, tree / "keep"):
        os.chown(p, OURS, OURS)
    # the swap happens when the cleanup looks at the tree again (old code: shutil.rmtree by path)
    calls = _swap_at(monkeypatch, ("stat", "lstat", "open"), "d", theirs, victim)
    removed = isolation._remove_files(OURS)
    monkeypatch.undo()
    assert calls, "the cleanup never looked at the tree"
    assert (victim / "d" / "keep").read_text() == "host data"
    assert removed == 1 and list((shared / "theirs.moved").iterdir()) == []
