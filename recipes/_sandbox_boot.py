"""Run before the sandboxed program: `python -I -S _sandbox_boot.py LEVEL main.py ARGS`.

A Python audit hook writes a line to stderr for every write outside the working directory (so a
refused write is reported even when the program catches the error), then main.py runs as
`__main__`. LEVEL `guard` (the `process` isolation level) also refuses those writes, process
creation, sockets and ctypes; `report` (the `namespaces` level, where the kernel refuses them)
only reports. A guard against accidents, not a security boundary (PEP 578: native code can
bypass audit hooks). This file is copied into the sandbox and run there; importing it does nothing.

Before any of that, at both levels, the kernel-side hardening of `_sandbox_seccomp.py` (copied next
to this file) is applied to this process: a fresh session keyring and the seccomp filter. It is the
boundary part: if it cannot be applied the program does not run (exit status 125, one line on
stderr).
"""

import importlib.util
import os
import runpy
import sys

_HARDENING = "_sandbox_seccomp.py"
_NOT_HARDENED = 125  # the exit status when the kernel-side hardening could not be applied

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {
    "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.truncate",
    "os.chmod", "os.chown", "os.utime", "shutil.rmtree", "shutil.move",
}  # fmt: skip
_PROCESS_EVENTS = {
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
    "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn",
}  # fmt: skip


def _hook(root: str, guard: bool):
    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an open file descriptor: its path was checked when it was opened
        real = os.path.realpath(os.fsdecode(path))
        if not guard and real.startswith("/dev/shm/"):
            return True  # the namespaces level's private scratch tmpfs: allowed, gone after the run
        return real == root or real.startswith(root + os.sep) or real == os.devnull

    def outside(path) -> None:
        os.write(2, f"[sandbox] write outside the working directory refused: {path}\n".encode())
        if guard:
            raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path}")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            by_mode = isinstance(mode, str) and any(c in mode for c in "wax+")
            writing = by_mode or (flags or 0) & _WRITE_FLAGS
            if writing and path is not None and not inside(path):
                outside(path)
        elif event in _PATH_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    outside(path)
        elif not guard:
            return
        elif event in _PROCESS_EVENTS:
            raise PermissionError(f"sandbox: process creation is not allowed ({event})")
        elif event.startswith("socket.") and event != "socket.gethostname":
            raise PermissionError(f"sandbox: network access is not allowed ({event})")
        elif event.startswith("ctypes."):
            raise PermissionError(f"sandbox: ctypes is not allowed ({event})")

    return hook


def _harden() -> None:
    """Load `_sandbox_seccomp.py` from beside this file (-I keeps it off sys.path) and apply it."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _HARDENING)
    spec = importlib.util.spec_from_file_location("_sandbox_seccomp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.join_fresh_session_keyring()
    module.install()


if __name__ == "__main__":
    try:
        _harden()
    except Exception as e:  # any failure: refuse to run the program unfiltered
        os.write(2, f"[sandbox] cannot apply the seccomp filter, not running the program: {e}\n".encode())
        os._exit(_NOT_HARDENED)
    sys.addaudithook(_hook(os.path.realpath(os.getcwd()), guard=sys.argv[1] == "guard"))
    del sys.argv[:2]
    runpy.run_path(sys.argv[0], run_name="__main__")
