"""The sandbox's limits hold for a whole run, not per process: memory, pids and disk.

Each attack runs at every isolation level this machine has (`process` needs root to mount its
tmpfs and make cgroups; the namespaces level needs what test_sandbox.NEEDS_NS says). At the process
level the programs first switch the audit hook off (`UNHOOK`): the limits must hold without it."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import pytest
from test_sandbox import NEEDS_NS
from test_sandbox_attacks import UNHOOK

from freetoken_agents.recipes import _sandbox_limits as limits_module
from freetoken_agents.recipes.sandbox import (
    SandboxLimits,
    disk_quota_available,
    limit_message,
    memory_control,
    run_python,
)

MIB = 1 << 20
NEEDS_CGROUP = pytest.mark.skipif(
    memory_control() == "rlimit", reason="no writable cgroup (v2 delegated or v1) here: memory is per process"
)
NEEDS_QUOTA = pytest.mark.skipif(
    not disk_quota_available(),
    reason="the process level cannot mount a tmpfs in a private mount namespace here",
)
ALL = [pytest.param("namespaces", marks=NEEDS_NS), "process"]
DISK = [pytest.param("namespaces", marks=NEEDS_NS), pytest.param("process", marks=NEEDS_QUOTA)]

# 7 children each touch 200 MiB (every page written) and hold it a moment.
MEMORY_FLOOD = (
    UNHOOK
    + """
import os, time
kids = []
for i in range(7):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (200 << 20)
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
print(sum(os.waitpid(pid, 0)[1] != 0 for pid in kids), "children failed")
"""
)


# Writes 4 MiB files until 1.2 GB or an error; reports the bytes that landed and the error number.
def _fill(folder: str, total_mb: int = 1200) -> str:
    return (
        UNHOOK
        + f"""
import os
written, err = 0, None
try:
    for i in range({total_mb} // 4):
        with open(os.path.join({folder!r}, f"f{{i}}"), "wb") as f:
            for _ in range(4):
                f.write(b"x" * (1 << 20))
                written += 1 << 20
except OSError as e:
    err = e.errno
print(written, err)
"""
    )


@NEEDS_CGROUP
@pytest.mark.parametrize("mode", ALL)
def test_seven_processes_share_one_memory_budget(mode):
    limits = SandboxLimits(memory_mb=256, processes=16, wall_time_s=120, cpu_time_s=30)
    result = run_python(MEMORY_FLOOD, limits=limits, isolation=mode)
    assert result.memory_control in ("cgroup1", "cgroup2")
    assert not result.passed and result.killed_by_limit == "memory", result
    assert result.error == limit_message("memory", limits)
    assert result.peak_memory_bytes is not None and result.peak_memory_bytes <= 256 * MIB


@NEEDS_CGROUP
@pytest.mark.parametrize("mode", ALL)
def test_a_pid_flood_stops_at_the_pid_limit(mode):
    source = UNHOOK + (
        "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\nfinally:\n    print(n)\n"
    )
    limits = SandboxLimits(processes=8, wall_time_s=60)
    result = run_python(source, limits=limits, isolation=mode)
    assert result.killed_by_limit == "processes" and not result.passed, result
    assert 0 < int(result.stdout.split()[0]) < 8


def _written(result) -> tuple[int, int | None]:
    written, err = result.stdout.split()
    return int(written), None if err == "None" else int(err)


@pytest.mark.parametrize("mode", DISK)
def test_many_files_in_the_working_dir_stop_at_disk_mb(mode):
    limits = SandboxLimits(disk_mb=64, file_size_mb=8, wall_time_s=120, cpu_time_s=30)
    result = run_python(_fill("."), limits=limits, isolation=mode)
    written, err = _written(result)
    assert result.disk_bounded and err == 28 and written <= 64 * MIB, result  # 28: ENOSPC


@pytest.mark.parametrize("mode", DISK)
@pytest.mark.parametrize("folder", ["/dev/shm", "/tmp", "/var/tmp"])
def test_shared_temp_dirs_count_within_the_same_quota(mode, folder):
    # 10 MiB in the working directory first: what is left of the 32 MiB for the temp dir is 22 MiB.
    source = "open('first', 'wb').write(b'x' * (10 << 20))\n" + _fill(folder, 600)
    limits = SandboxLimits(disk_mb=32, file_size_mb=16, wall_time_s=120, cpu_time_s=30)
    result = run_python(source, limits=limits, isolation=mode)
    written, err = _written(result)
    if mode == "namespaces" and folder != "/dev/shm":
        assert err in (2, 30) and written == 0, result  # absent (ENOENT) or the read-only new root (EROFS)
    else:
        assert err == 28 and 0 < written <= 22 * MIB, result  # 28: ENOSPC


def _sandbox_cgroups() -> set[Path]:
    own = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    parents = [
        Path("/sys/fs/cgroup", names.split(",")[0] if names else "", path.lstrip("/"))
        for _, names, path in own
    ]
    return {p for d in parents if d.is_dir() for p in d.glob("freetoken-sandbox-*")}


@pytest.mark.parametrize("mode", DISK)
def test_no_mount_or_cgroup_outlives_a_run(mode, monkeypatch, tmp_path):
    # Other processes on the machine (a concurrent test run, the docs' recipe blocks) may be running
    # sandboxes of their own: this run's disk is made under tmp_path, so its mounts are told apart
    # by path, and a cgroup that was not there before must go away (another run's ends with it;
    # a leaked one never does).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _sandbox_cgroups()
    result = run_python(UNHOOK + "open('/dev/shm/x', 'w').write('y')\nprint(1)", isolation=mode)
    assert result.passed, result
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(tmp_path) not in mounts
    new = _sandbox_cgroups() - before
    deadline = time.monotonic() + 60
    while new and time.monotonic() < deadline:
        time.sleep(0.5)
        new = {p for p in new if p.exists()}
    assert new == set()
    assert not os.path.exists("/dev/shm/x")


def test_without_a_writable_cgroup_the_weaker_level_is_used_and_reported(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(limits_module, "_CGROUP", tmp_path / "no-cgroupfs")
    limits_module._warn_rlimit_only.cache_clear()
    assert memory_control() == "rlimit"
    with caplog.at_level(logging.INFO, logger="freetoken_agents.recipes"):
        result = run_python("print(1)", isolation="process")
    assert result.passed and result.memory_control == "rlimit" and result.peak_memory_bytes is None
    assert "memory is bounded only per process" in caplog.text
    assert "memory/pids bounded by rlimit" in caplog.text
