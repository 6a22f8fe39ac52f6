"""The sandbox's kernel-side hardening (`_sandbox_seccomp.py`, applied by the boot at both levels):
the seccomp filter answers EPERM to namespace creation, io_uring, the key calls and ptrace while
ordinary programs keep working, and no kernel key survives from one run into the next.

At the process level the audit hook would stop these programs before the kernel is asked (it
refuses ctypes and subprocess), so they first switch it off (`UNHOOK`): what is tested is what
holds without it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import uuid

import pytest
from test_sandbox import MODES
from test_sandbox_attacks import UNHOOK

from freetoken_agents.recipes import _sandbox_seccomp as seccomp
from freetoken_agents.recipes.sandbox import SandboxError, run_python

SYSCALLS = """
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
NR = {
    "x86_64": {"unshare": 272, "clone": 56, "io_uring_setup": 425, "keyctl": 250, "ptrace": 101},
    "aarch64": {"unshare": 97, "clone": 220, "io_uring_setup": 425, "keyctl": 219, "ptrace": 117},
}[platform.machine()]
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
params = ctypes.create_string_buffer(120)
for name, args in [
    ("unshare", (CLONE_NEWUSER,)),
    ("clone", (CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)),
    ("io_uring_setup", (1, params)),
    ("keyctl", (0, -3, 0)),  # KEYCTL_GET_KEYRING_ID of the session keyring
    ("ptrace", (2, 999999999, 0, 0)),  # PTRACE_PEEKDATA of no process: ESRCH when allowed
]:
    r = libc.syscall(NR[name], *args)
    if r == 0 and name == "clone":
        os._exit(0)  # the child of an allowed clone
    err = ctypes.get_errno()
    print(name, "EPERM" if r == -1 and err == 1 else f"allowed ({r}, errno {err})")
"""

NORMAL = """
import subprocess, sys, threading
out = []
threads = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
child = subprocess.run([sys.executable, "-I", "-S", "-c", "print(6 * 7)"], capture_output=True, text=True)
with open("data.txt", "w") as f:
    f.write("kept")
print(sorted(out), child.stdout.strip(), child.returncode, open("data.txt").read())
"""

KEYS = """
import ctypes, platform, sys
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
add_key, keyctl = NR
SESSION, USER = -3, -4
desc, secret = sys.argv[1].encode(), sys.argv[2].encode()
if sys.argv[3] == "add":
    for ring in (SESSION, USER):
        r = libc.syscall(add_key, b"user", desc, secret, len(secret), ring)
        print("add", ring, r, ctypes.get_errno())
else:
    for ring in (SESSION, USER):
        key = libc.syscall(keyctl, 10, ring, b"user", desc, 0)  # KEYCTL_SEARCH
        buf = ctypes.create_string_buffer(256)
        n = libc.syscall(keyctl, 11, key, buf, 256) if key > 0 else -1  # KEYCTL_READ
        print("read", ring, key, buf.raw[: max(n, 0)])
"""


def _program(mode: str, source: str) -> str:
    return (UNHOOK if mode == "process" else "") + source


@pytest.mark.parametrize("mode", MODES)
def test_namespaces_io_uring_keys_and_ptrace_get_eperm(mode):
    result = run_python(_program(mode, SYSCALLS), isolation=mode)
    assert result.passed, result.stderr
    assert result.isolation == mode
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines == {name: "EPERM" for name in ("unshare", "clone", "io_uring_setup", "keyctl", "ptrace")}


@pytest.mark.parametrize("mode", MODES)
def test_threads_subprocesses_and_files_still_work(mode):
    result = run_python(_program(mode, NORMAL), isolation=mode)
    assert result.passed, result.stderr
    assert result.stdout.strip() == "[0, 1, 2, 3] 42 0 kept"


# The two runs are started from a child interpreter that has its own session keyring (as a login
# shell or an ssh session has, through pam_keyinit): without the fix every run inherits it, and
# possesses whatever an earlier run put there, whatever its uid.
TWO_RUNS = """
import ctypes, json, platform, sys
from freetoken_agents.recipes.sandbox import run_python
libc = ctypes.CDLL(None, use_errno=True)
keyctl = {"x86_64": 250, "aarch64": 219}[platform.machine()]
if libc.syscall(keyctl, 1, b"freetoken-test-session") < 0:  # KEYCTL_JOIN_SESSION_KEYRING
    sys.exit("cannot join a session keyring here")
program, mode, desc, secret = json.loads(sys.argv[1])
runs = [run_python(program, isolation=mode, args=[desc, secret, step]) for step in ("add", "read")]
print(json.dumps([[r.passed, r.stdout, r.stderr] for r in runs]))
"""


@pytest.mark.skipif(not os.path.exists("/proc/keys"), reason="the kernel has no key retention service")
@pytest.mark.parametrize("mode", MODES)
def test_a_key_added_in_one_run_cannot_be_read_in_the_next(mode):
    desc, secret = f"freetoken-{uuid.uuid4().hex}", uuid.uuid4().hex
    spec = json.dumps([_program(mode, KEYS), mode, desc, secret])
    done = subprocess.run([sys.executable, "-c", TWO_RUNS, spec], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (first_ok, _, first_err), (second_ok, second_out, second_err) = json.loads(done.stdout)
    assert first_ok and second_ok, first_err + second_err
    assert second_out.count("read ") == 2  # both keyrings were searched
    assert secret not in second_out


def test_the_filter_exists_for_the_known_architectures_and_refuses_others(monkeypatch):
    for machine in ("x86_64", "aarch64"):
        code = seccomp.build_filter(machine)
        assert len(code) % 8 == 0 and 40 < len(code) // 8 < 256
    with pytest.raises(seccomp.SeccompUnsupported, match="riscv64"):
        seccomp.build_filter("riscv64")
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    with pytest.raises(SandboxError, match="seccomp"):
        run_python("print(1)", isolation="process")


@pytest.mark.parametrize("mode", MODES)
def test_a_filter_that_cannot_be_installed_stops_the_run_before_the_program(mode, tmp_path, monkeypatch):
    from freetoken_agents.recipes import sandbox

    broken = tmp_path / "_sandbox_seccomp.py"
    broken.write_text(
        "def join_fresh_session_keyring():\n    return True\n"
        "def install():\n    raise OSError(22, 'the kernel refused the filter')\n"
    )
    monkeypatch.setattr(sandbox, "_HARDENING", broken)
    result = run_python("print('ran unfiltered')", isolation=mode)
    assert not result.passed
    assert "ran unfiltered" not in result.stdout
    assert result.error.startswith("[sandbox] cannot apply the seccomp filter, not running the program")


def test_the_hardening_file_name_is_reserved():
    with pytest.raises(ValueError, match="_sandbox_seccomp.py"):
        run_python("print(1)", files={"_sandbox_seccomp.py": "def install():\n    pass\n"})
