"""The recipes' sandbox: runaway programs are stopped and reported, and the host is unharmed.

Both isolation levels run where they can: `process` (rlimits + audit hook, an unprivileged uid
when root) everywhere, and `namespaces` (unique uid, a new root with a read-only runtime view, no
network, PID/IPC/UTS namespaces) on Linux as root, which is where these tests run in CI; elsewhere
those cases are skipped with the reason. The coding recipe's verdict and the isolation attacks
are in test_sandbox_attacks.py."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from freetoken_agents.recipes.coding_solver import check_code
from freetoken_agents.recipes.sandbox import SandboxLimits, namespaces_available, run_python

NEEDS_NS = pytest.mark.skipif(not namespaces_available(), reason="namespaces need Linux, root, unshare")
MODES = [pytest.param("namespaces", marks=NEEDS_NS), "process"]
FAST = SandboxLimits(wall_time_s=20, cpu_time_s=1, memory_mb=128, output_bytes=4096, processes=16)


def live_processes_with(marker: str) -> list[int]:
    """pids whose command line contains `marker` (the sandboxed program gets it as argv[1])."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("mode", MODES)
def test_runs_in_a_fresh_directory_with_a_scrubbed_environment(mode, monkeypatch):
    monkeypatch.setenv("FREETOKEN_TEST_SECRET", "hunter2")
    source = "import os, sys\nprint(os.getcwd())\nprint(sorted(os.environ))\nprint(sys.flags.isolated)"
    result = run_python(source, files={"data.txt": "hello"}, isolation=mode)
    assert result.passed and result.error is None and result.isolation == mode
    cwd, env, isolated = result.stdout.splitlines()
    assert cwd != os.getcwd() and "freetoken-sandbox-" in cwd
    assert not Path(cwd).exists()  # removed after the run
    assert "FREETOKEN_TEST_SECRET" not in env and "PYTHONPATH" not in env
    assert isolated == "1"
    assert result.network_isolated == (mode == "namespaces")


@pytest.mark.parametrize("mode", MODES)
def test_cpu_runaway_is_stopped(mode):
    result = run_python("while True:\n    pass", limits=FAST, isolation=mode)
    assert not result.passed and result.killed_by_limit == "cpu_time" and not result.timed_out
    assert result.error == "TimeoutError: the program used more than 1 s of CPU time"


@pytest.mark.parametrize("mode", MODES)
def test_wall_time_runaway_is_killed(mode):
    limits = SandboxLimits(wall_time_s=0.5)
    result = run_python("import time\ntime.sleep(60)", limits=limits, isolation=mode)
    assert result.timed_out and result.killed_by_limit == "wall_time" and result.returncode == -9
    assert result.seconds < 5
    assert result.error == "TimeoutError: the program ran longer than 0.5 s"


GROW = "x = []\nwhile True:\n    x.append(' ' * 10**6)"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", ["x = bytearray(10**10)", GROW])
def test_huge_allocation_hits_the_memory_limit(mode, source):
    result = run_python(source, limits=FAST, isolation=mode)
    assert not result.passed and result.killed_by_limit == "memory"
    assert result.error == "MemoryError: the program went over its memory limit of 128 MiB"


@pytest.mark.parametrize("mode", MODES)
def test_huge_output_is_capped_and_killed(mode):
    result = run_python("while True:\n    print('x' * 1000)", limits=FAST, isolation=mode)
    assert result.killed_by_limit == "output" and not result.passed
    assert 0 < len(result.stdout) <= FAST.output_bytes


@pytest.mark.parametrize("mode", MODES)
def test_huge_file_hits_the_file_size_limit(mode):
    limits = SandboxLimits(file_size_mb=1)
    result = run_python("open('big.bin', 'wb').write(b'0' * (4 << 20))", limits=limits, isolation=mode)
    assert result.killed_by_limit == "file_size" and not result.passed


@pytest.mark.parametrize("mode", MODES)
def test_writing_outside_the_directory_is_refused(mode, tmp_path):
    targets = [tmp_path / f"leak-{uuid.uuid4().hex}", Path("/tmp") / f"freetoken-leak-{uuid.uuid4().hex}"]
    source = "\n".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n    print(e)" for t in targets
    )
    result = run_python(source, isolation=mode)
    assert result.write_outside_refused
    assert not any(t.exists() for t in targets)
    assert len(result.stdout.splitlines()) == 2  # both writes raised inside the program


@NEEDS_NS
def test_namespaces_refuse_writes_from_child_processes_too():
    target = Path("/tmp") / f"freetoken-leak-{uuid.uuid4().hex}"
    source = f"import os\nprint(os.system('echo x > {target}'))"
    result = run_python(source, isolation="namespaces")
    assert result.stdout.strip() != "0" and not target.exists()  # the shell's write failed
    assert result.write_outside_refused  # sh: "Read-only file system" on stderr


@NEEDS_NS
def test_namespaces_fork_bomb_is_contained_and_cleaned_up():
    marker = f"bomb-{uuid.uuid4().hex}"
    source = "import os, time\nwhile True:\n    os.fork()"
    limits = SandboxLimits(processes=16, output_bytes=200_000)  # room for the children's tracebacks
    result = run_python(source, limits=limits, isolation="namespaces", args=[marker])
    assert result.killed_by_limit == "processes" and not result.passed
    assert live_processes_with(marker) == []


@NEEDS_NS
def test_namespaces_escaped_daemon_dies_with_the_run():
    marker = f"daemon-{uuid.uuid4().hex}"
    source = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = run_python(source, isolation="namespaces", args=[marker])
    assert result.passed and result.stdout == "parent done\n"
    assert live_processes_with(marker) == []


def test_process_level_refuses_process_creation():
    marker = f"fork-{uuid.uuid4().hex}"
    # A bounded fork loop: if the guard failed, this must not hurt the machine.
    source = "import os\nfor _ in range(50):\n    if os.fork() == 0:\n        os._exit(0)"
    result = run_python(source, isolation="process", args=[marker])
    assert not result.passed and "process creation is not allowed (os.fork)" in result.error
    assert live_processes_with(marker) == []


@pytest.mark.parametrize("mode", MODES)
def test_no_network(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\nprint('connected')"
        result = run_python(source, isolation=mode)
    assert not result.passed and "connected" not in result.stdout
    expected = "Network is unreachable" if mode == "namespaces" else "network access is not allowed"
    assert expected in result.error


def test_file_names_must_be_plain():
    with pytest.raises(ValueError, match="plain names"):
        run_python("pass", files={"../escape.py": "x"})


# ---- the coding recipe's test harness (one-line errors in the embedded model's training format) --
@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("def f(x):\n    return x + 2\n", "AssertionError: f(0) returned 2, expected 1"),
        ("def f(x:\n    return x\n", "SyntaxError: '(' was never closed (line 1)"),
        ("def f(x):\n    return y\n", "NameError: name 'y' is not defined"),
        ("def f(x, y):\n    return x\n", "TypeError: f() missing 1 required positional argument: 'y'"),
        ("import sys\nsys.exit(0)\n", "the program exited before its tests ran"),
    ],
)
def test_check_code_reports_one_line(code, error):
    result = check_code(code, ["assert f(0) == 1", "assert f(1) == 2"])
    assert not result.passed and result.error == error


def test_check_code_passes_correct_code():
    result = check_code("def f(x):\n    return x + 1\n", ["assert f(0) == 1", "assert f(1) == 2"])
    assert result.passed and result.error is None
