"""The sandbox against hostile code: faked test verdicts, and what a run may touch or leave behind.

Each attack runs at every isolation level this machine has. The process level's audit hook is a
guard against accidents, not a boundary, so the attacks there first switch it off (`UNHOOK`, the
few lines of `gc` a determined program needs) and the tests check what holds without it: the
unprivileged uid, and the cleanup after the run."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path

import pytest
from test_sandbox import MODES, NEEDS_NS, live_processes_with

from freetoken_agents.recipes import _sandbox_isolation as isolation
from freetoken_agents.recipes.coding_solver import check_code
from freetoken_agents.recipes.sandbox import SandboxError, namespaces_available, run_python

NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")

# Neutralises the process level's audit hook (its `guard` flag lives in a closure cell).
UNHOOK = """
import gc
for f in gc.get_objects():
    if type(f).__name__ == "function" and f.__name__ == "hook" and f.__closure__:
        for cell in f.__closure__:
            if cell.cell_contents is True:
                cell.cell_contents = False
"""

TESTS = ["assert inc(1) == 2", "assert inc(41) == 42"]
FAKE_PASSES = {
    "prints the nonce in argv, exits 0": "import sys,os\nprint(sys.argv[1]); sys.stdout.flush();os._exit(0)",
    "patches sys.exit": "import sys\nsys.exit = lambda *a: None\ndef inc(x):\n    return x\n",
    "exits 0 from atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\nraise SystemExit(0)",
    "patches builtins, == always True": (
        "import builtins\nbuiltins.AssertionError = type('A', (Exception,), {})\n"
        "class Yes(int):\n    def __eq__(self, other):\n        return True\n"
        "def inc(x):\n    return Yes(0)\n"
    ),
    "says ready on the channel, then exits": (
        "import os, json\nfd = int(os.environ['FREETOKEN_SANDBOX_CHANNEL'].split(',')[1])\n"
        "d = json.dumps({'ready': True}).encode()\nos.write(fd, len(d).to_bytes(4, 'big') + d)\nos._exit(0)"
    ),
    "floods the channel": (
        "import os\nfd = int(os.environ['FREETOKEN_SANDBOX_CHANNEL'].split(',')[1])\n"
        "os.write(fd, (10**9).to_bytes(4, 'big'))\ndef inc(x):\n    return x + 1\n"
    ),
    "answers with garbage": (
        "import os\nfd = int(os.environ['FREETOKEN_SANDBOX_CHANNEL'].split(',')[1])\n"
        "os.write(fd, (5).to_bytes(4, 'big') + b'[1,2]')\nos._exit(0)"
    ),
}


@pytest.fixture
def no_unshare(monkeypatch, tmp_path):
    """`unshare` missing from PATH (the probe is re-run, and re-run again afterwards)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    namespaces_available.cache_clear()
    yield
    namespaces_available.cache_clear()


# ---- the coding recipe's verdict ----------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(FAKE_PASSES))
def test_fake_passes_are_failures(mode, name):
    result = check_code(FAKE_PASSES[name], TESTS, isolation=mode)
    assert not result.passed and result.error, result


@pytest.mark.parametrize("mode", MODES)
def test_right_code_passes_and_wrong_code_names_the_failing_test(mode):
    assert check_code("def inc(x):\n    return x + 1\n", TESTS, isolation=mode).passed
    wrong = check_code("def inc(x):\n    return 2 if x == 1 else x\n", TESTS, isolation=mode)
    assert not wrong.passed and wrong.error == "AssertionError: inc(41) returned 41, expected 42"


def test_the_judge_evaluates_tests_here_with_the_solutions_names():
    code = (
        "import math\nLIMIT = 3\ndef max(xs):\n    return -1\n"
        "def check(x):\n    if x < 0:\n        raise ValueError('negative')\n    return (x, [x], {x: {x}})\n"
        "class Box:\n    pass\ndef box():\n    return Box()\n"
    )
    tests = [
        "assert max([5]) == 5",  # a builtin in a test is the real one, whatever the solution defines
        "assert check(2) == (2, [2], {2: {2}}) and LIMIT == 3 and math.floor(2.5) == 2",
        "try:\n    check(-1)\n    raise AssertionError('no error')\n"
        "except ValueError as e:\n    assert str(e) == 'negative'",
    ]
    assert check_code(code, tests).passed
    boxed = check_code(code, ["assert box() is not None"])
    assert not boxed.passed and boxed.error.startswith("TypeError: box() returned a Box, which cannot leave")
    raised = check_code(code, ["assert check(-1) == 1"])
    assert not raised.passed and raised.error == "ValueError: negative"
    with pytest.raises(ValueError, match="not valid Python"):
        check_code(code, ["assert check(1) =="])


def test_a_call_that_exits_the_program_fails():
    result = check_code("import os\ndef inc(x):\n    os._exit(0)\n", TESTS)
    assert not result.passed and result.error == "the program exited while its tests ran"


# ---- what a run may touch -----------------------------------------------------------------------
@NEEDS_NS
def test_namespaces_show_only_a_read_only_runtime():
    source = (
        "import os\nprint(sorted(os.listdir('/')))\n"
        "for p in ('/etc/passwd', '/etc/shadow', '/home', '/var', '/run'):\n    print(os.path.exists(p))\n"
        "try:\n    open('/usr/freetoken-x', 'w')\nexcept OSError as e:\n    print(e.errno)\n"
        "print(os.uname().nodename)"
    )
    result = run_python(source, isolation="namespaces")
    listing, *rest = result.stdout.splitlines()
    runtime = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "root"}  # etc: ld.so.cache
    assert set(eval(listing)) - runtime == {"dev", "proc", "tmp"}
    assert rest == ["False"] * 5 + ["30", "sandbox"]  # 30: EROFS


@NEEDS_NS
def test_host_unix_sockets_are_unreachable(tmp_path):
    path = f"/tmp/freetoken-sock-{uuid.uuid4().hex[:8]}"
    abstract = f"\0freetoken-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as hidden:
        server.bind(path)
        os.chmod(path, 0o666)
        server.listen()
        hidden.bind(abstract)
        hidden.listen()
        source = (
            "import socket, sys\nfor address in sys.argv[1:]:\n    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n        s.connect(address.replace('@', chr(0)))\n        print('connected')\n"
            "    except OSError as e:\n        print(type(e).__name__)\n"
        )
        result = run_python(source, isolation="namespaces", args=[path, "@" + abstract[1:]])
    os.unlink(path)
    assert "connected" not in result.stdout and len(result.stdout.splitlines()) == 2


def _traces_source(marker: str, keys: list[int]) -> str:
    """A program that tries to leave files, SysV IPC objects and a process behind."""
    files = [f"/tmp/{marker}", f"/var/tmp/{marker}", f"/dev/shm/{marker}"]
    return (
        UNHOOK
        + f"import ctypes, os, time\nfiles = {files!r}\n"
        + "for p in files:\n    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n"
        + f"try:\n    os.mkdir('/tmp/{marker}.d'); open('/tmp/{marker}.d/f', 'w').write('x')\n"
        + f"    os.symlink('/etc/hostname', '/tmp/{marker}.link')\nexcept OSError:\n    pass\n"
        + "libc = ctypes.CDLL(None)\n"
        + f"for key in {keys!r}:\n    libc.shmget(key, 64 << 20, 0o1000 | 0o666)\n"
        + f"libc.semget({keys[0]}, 1, 0o1000 | 0o666)\nlibc.msgget({keys[0]}, 0o1000 | 0o666)\n"
        + "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\nprint('done')\n"
    )


def _ipc_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "sem", "msg"):
        for line in Path("/proc/sysvipc", kind).read_text().splitlines()[1:]:
            keys.add(int(line.split()[0]))
    return keys


ROOT_MODES = [pytest.param("namespaces", marks=NEEDS_NS), pytest.param("process", marks=NEEDS_ROOT)]


@pytest.mark.parametrize("mode", ROOT_MODES)
def test_nothing_outlives_a_run(mode):
    marker = f"freetoken-trace-{uuid.uuid4().hex}"
    keys = [0x5EED0000 + int(uuid.uuid4().hex[:4], 16) * 4 + i for i in range(4)]
    hostname = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else None
    result = run_python(_traces_source(marker, keys), isolation=mode, args=[marker])
    assert result.passed and result.stdout == "done\n", result
    assert live_processes_with(marker) == []
    assert not set(keys) & _ipc_keys()
    left = [p for d in ("/tmp", "/var/tmp", "/dev/shm") for p in Path(d).glob(f"{marker}*")]
    assert left == []
    if hostname is not None:
        assert Path("/etc/hostname").read_bytes() == hostname  # the link was removed, not its target


@NEEDS_ROOT
def test_process_level_runs_unprivileged_and_cannot_reach_its_parent():
    source = (
        UNHOOK + "import os, signal\n"
        "print(os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups())\n"
        "status = open('/proc/self/status').read()\nprint(status.split('NoNewPrivs:')[1].split()[0])\n"
        "for p in ('/etc/shadow', f'/proc/{os.getppid()}/environ', '/root'):\n"
        "    try:\n        open(p, 'rb') if p != '/root' else os.listdir(p)\n        print('read', p)\n"
        "    except PermissionError:\n        print('refused')\n"
        "try:\n    signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGTERM)\n"
        "    print('signalled')\n"
        "except PermissionError:\n    print('refused')\n"
    )
    result = run_python(source, isolation="process")
    ids, no_new_privs, *refusals = result.stdout.splitlines()
    uid, euid, gid, egid = (int(x) for x in ids.split()[:4])
    assert 0 not in (uid, euid, gid, egid) and uid == euid and ids.endswith("[]")
    assert no_new_privs == "1" and refusals == ["refused"] * 4


def test_auto_without_unshare_falls_back_to_the_process_level_and_says_so(no_unshare, caplog):
    with caplog.at_level(logging.INFO, logger="freetoken_agents.recipes.sandbox"):
        result = run_python("import os\nprint(os.geteuid())", isolation="auto")
    assert result.isolation == "process" and result.stdout.strip() != "0"
    assert "sandbox: process isolation (asked for 'auto')" in caplog.text
    with pytest.raises(SandboxError, match="isolation='namespaces' needs"):
        run_python("pass", isolation="namespaces")
    assert check_code("def inc(x):\n    return x + 1\n", TESTS).passed


@NEEDS_ROOT
def test_process_level_refuses_when_the_uid_cannot_reach_a_python(monkeypatch, tmp_path):
    closed = tmp_path / "closed"
    (closed / "bin").mkdir(parents=True)
    os.chmod(closed, 0o700)
    monkeypatch.setattr(isolation, "interpreter", lambda: str(closed / "bin" / "python"))
    monkeypatch.setattr(isolation, "SANDBOX_PATH", str(tmp_path / "empty"))
    with pytest.raises(SandboxError, match="will not run model code as root"):
        run_python("print(1)", isolation="process")
