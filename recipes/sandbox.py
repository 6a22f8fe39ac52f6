"""Run untrusted Python (a model's code and its tests) in a subprocess with limits.

    result = run_python("print(1 + 1)", limits=SandboxLimits(wall_time_s=2))
    result.passed, result.stdout, result.error

Every run: a fresh temporary directory as the working directory, `python -I -S` (no user site,
no site-packages: the standard library only), an environment with nothing of ours in it, stdin
closed, and resource limits set in `preexec_fn` (RLIMIT_AS memory, RLIMIT_CPU, RLIMIT_FSIZE,
RLIMIT_NPROC, RLIMIT_NOFILE, no core files). We SIGKILL the whole run past the wall-time limit or
when stdout + stderr exceed the output cap, and read at most that much output.

What else is guaranteed depends on the isolation level (`SandboxResult.isolation`):

- `namespaces` (Linux, root, util-linux `unshare` and `setpriv`; chosen by "auto" when a probe
  succeeds): the program runs in new mount, network and PID namespaces as a fresh unprivileged
  uid with no capabilities and no_new_privs. It has no network (its namespace has only a down
  loopback). Its working directory is a private tmpfs of `disk_mb`; every other mount is
  remounted read-only and /dev/shm is a small private tmpfs, so it cannot write anywhere on the
  host: the kernel refuses (EROFS / EACCES) and nothing it writes outlives the run. RLIMIT_NPROC
  counts that uid alone, so a fork bomb hits the limit; when the run ends or is killed, the PID
  namespace dies with every process in it. It can still read world-readable files.
- `process` (anywhere else): the same limits as the current user, plus a Python audit hook that
  refuses writes outside the working directory, process creation, sockets and ctypes. That hook
  is a guard against accidents, not a security boundary (PEP 578): native code can bypass it,
  and without root RLIMIT_NPROC counts all of the user's processes. The working directory is on
  the host's disk (removed after the run): RLIMIT_FSIZE bounds each file, not their number.

`SandboxResult.write_outside_refused` reports a refused write outside the working directory:
at both levels an audit hook writes a line to stderr for every Python-level attempt (so it shows
even when the program catches the error); at the namespaces level a child process's attempt
shows only if its "Read-only file system" error reaches stderr (it is refused all the same).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from . import RecipeError

logger = logging.getLogger(__name__)

Isolation = Literal["auto", "namespaces", "process"]
_BOOT = Path(__file__).with_name("_sandbox_boot.py")
LimitKind = Literal["wall_time", "cpu_time", "memory", "file_size", "output", "processes"]


class SandboxError(RecipeError):
    """Raised when the sandbox cannot run a program at all (not when the program fails): the
    requested isolation level is not available here, or the interpreter cannot be started."""


class SandboxLimits(BaseModel):
    """Resource limits of one run."""

    model_config = ConfigDict(frozen=True)

    wall_time_s: float = Field(default=5.0, gt=0, description="wall-clock seconds before SIGKILL")
    cpu_time_s: int = Field(default=5, ge=1, description="RLIMIT_CPU seconds (SIGXCPU, then SIGKILL)")
    memory_mb: int = Field(default=256, ge=32, description="RLIMIT_AS: address space, MiB")
    file_size_mb: int = Field(default=8, ge=1, description="RLIMIT_FSIZE: largest file written, MiB")
    disk_mb: int = Field(default=32, ge=1, description="namespaces: size of the working-dir tmpfs, MiB")
    processes: int = Field(default=32, ge=1, description="RLIMIT_NPROC for the sandbox's uid")
    open_files: int = Field(default=64, ge=16, description="RLIMIT_NOFILE")
    output_bytes: int = Field(default=64_000, ge=1024, description="stdout + stderr cap; SIGKILL past it")


class SandboxResult(BaseModel):
    """What a run did. `passed`: exit status 0 and no limit hit."""

    passed: bool
    returncode: int | None = Field(description="exit status; negative: killed by that signal")
    error: str | None = Field(default=None, description="one-line summary of the failure")
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    killed_by_limit: LimitKind | None = None
    write_outside_refused: bool = Field(
        default=False, description="the program tried to write outside its directory and was refused"
    )
    isolation: Literal["namespaces", "process"]
    network_isolated: bool = Field(description="True when the program had no network at all")
    seconds: float = 0.0


def run_python(
    source: str,
    *,
    files: Mapping[str, str] | None = None,
    limits: SandboxLimits | None = None,
    isolation: Isolation = "auto",
    args: Sequence[str] = (),
) -> SandboxResult:
    """Run `source` as `main.py` (with `files`, name -> text, beside it) in a fresh sandbox.

    Raises SandboxError when `isolation` names a level this machine cannot provide."""
    limits = limits or SandboxLimits()
    mode = _resolve(isolation)
    with tempfile.TemporaryDirectory(prefix="freetoken-sandbox-") as tmp:
        root = Path(tmp)
        work, src = root / "work", root / "src"
        work.mkdir()
        src.mkdir()
        for name, text in {**(files or {}), "main.py": source}.items():
            if Path(name).name != name or name == _BOOT.name:
                raise ValueError(f"sandbox file names must be plain names (not {_BOOT.name}), got {name!r}")
            (src / name).write_text(text)
        shutil.copyfile(_BOOT, src / _BOOT.name)
        if mode == "namespaces":
            os.chmod(root, 0o755)  # the sandbox uid must reach its mount point
            uid = secrets.randbelow(1_000_000_000) + 1_000_000_000  # a uid no one else has
            cmd = _namespace_command(root, uid, limits, args)
        else:
            shutil.copytree(src, work, dirs_exist_ok=True)
            cmd = [_interpreter(), "-I", "-S", _BOOT.name, "guard", "main.py", *args]
        logger.debug("sandbox run (%s isolation) in %s", mode, work)
        t0 = time.perf_counter()
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=work,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=_environment(),
                preexec_fn=functools.partial(_set_limits, limits),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            raise SandboxError(f"cannot start the sandbox ({cmd[0]}): {e}") from e
        stdout, stderr, ours = _collect(proc, limits)
        seconds = time.perf_counter() - t0
    return _result(proc.returncode, stdout, stderr, ours, limits, mode, seconds)


@functools.cache
def namespaces_available() -> bool:
    """True when the `namespaces` level works here (probed once per process)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    if not (shutil.which("unshare") and shutil.which("setpriv") and shutil.which("mount")):
        return False
    if _hidden_dir(Path(_prefix())) is False:
        return False
    # The same namespaces, a mount, and a switch to an unprivileged uid, as a run does them.
    check = "mount -t tmpfs probe /tmp && setpriv --reuid=65534 --regid=65534 --clear-groups true"
    probe = [*_UNSHARE, "/bin/sh", "-c", check]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=10, env=_environment())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _resolve(isolation: Isolation) -> Literal["namespaces", "process"]:
    if isolation == "process":
        return "process"
    if namespaces_available():
        return "namespaces"
    if isolation == "namespaces":
        raise SandboxError(
            "isolation='namespaces' needs Linux, root and util-linux's unshare and setpriv; "
            "use isolation='process' (rlimits and an audit hook) instead"
        )
    return "process"


# ---- limits and environment ----------------------------------------------------------------------
def _set_limits(limits: SandboxLimits) -> None:
    """preexec_fn: runs in the child between fork and exec (only async-signal-safe-ish calls)."""
    mib = 1 << 20
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mib, limits.memory_mb * mib))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_time_s, limits.cpu_time_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_mb * mib, limits.file_size_mb * mib))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _environment() -> dict[str, str]:
    """A scrubbed environment: none of ours (no tokens, no proxies, no PYTHONPATH)."""
    path = "/usr/local/bin:/usr/bin:/bin"
    return {"PATH": path, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/nonexistent"}


def _interpreter() -> str:
    """The base interpreter (a venv's python resolves to it; -S does not need the venv)."""
    return os.path.realpath(sys.executable)


def _prefix() -> str:
    """The installation the interpreter runs from (its binary and standard library)."""
    exe, prefix = _interpreter(), os.path.realpath(sys.base_prefix)
    return prefix if exe.startswith(prefix + os.sep) else str(Path(exe).parent.parent)


# ---- namespaces ---------------------------------------------------------------------------------
_UNSHARE = ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]

# Runs as root inside the new namespaces, then runs the program as the sandbox uid. The shell
# stays PID 1 (no exec) so the program gets ordinary signal handling (PID 1 ignores SIGXCPU).
_NS_SCRIPT = r"""
set -e
root=$1; uid=$2; disk=$3; prefix=$4; hide=$5; shift 5
mount -t tmpfs -o "size=${disk}k,mode=0700,uid=$uid,gid=$uid,nosuid,nodev" sandbox "$root/work"
cp -R "$root/src/." "$root/work/"
chown -R "$uid:$uid" "$root/work"
if [ -n "$hide" ]; then
  mkdir "$root/py"
  mount --bind "$prefix" "$root/py"
  mount -t tmpfs -o size=64k,mode=0755 hidden "$hide"
  mkdir -p "$prefix"
  mount --bind "$root/py" "$prefix"
fi
for mp in $(cut -d' ' -f5 /proc/self/mountinfo | sort -u); do
  case "$mp" in
    "$root/work"|/proc|/proc/*|/dev|/dev/pts|/dev/shm|/dev/mqueue) ;;
    *) mount -o remount,bind,ro "$mp" 2>/dev/null || true ;;
  esac
done
mount -t tmpfs -o size=1m,mode=1777,nosuid,nodev shm /dev/shm
cd "$root/work"
set +e
setpriv --reuid="$uid" --regid="$uid" --clear-groups --inh-caps=-all --bounding-set=-all \
  --no-new-privs -- "$@"
exit $?
"""


def _namespace_command(root: Path, uid: int, limits: SandboxLimits, args: Sequence[str]) -> list[str]:
    exe, prefix = _interpreter(), _prefix()
    hide = _hidden_dir(Path(prefix))
    if hide is False or (hide and root.resolve().is_relative_to(hide)):
        raise SandboxError(f"the sandbox uid could not reach {exe} or its working directory {root}")
    disk_kb = limits.disk_mb * 1024
    return [
        *_UNSHARE,
        "/bin/sh",
        "-c",
        _NS_SCRIPT,
        "sh",
        str(root),
        str(uid),
        str(disk_kb),
        prefix,
        str(hide or ""),
        exe,
        "-I",
        "-S",
        _BOOT.name,
        "report",
        "main.py",
        *args,
    ]


def _hidden_dir(path: Path) -> Path | None | Literal[False]:
    """The outermost directory above `path` that others cannot traverse (it is covered by a tmpfs
    in the namespace and the interpreter bound back in); None when all are traversable; False
    when `path` is the blocked one itself (the interpreter cannot be reached at all)."""
    parts = path.resolve().parts
    for i in range(1, len(parts) + 1):
        d = Path(*parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d if d != path.resolve() and d != Path("/") else False
    return None


# ---- output and results -------------------------------------------------------------------------
def _collect(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[bytes, bytes, LimitKind | None]:
    """Read stdout/stderr (up to the cap) until both close and the program exits, or a limit
    hits; then kill what is left of its process group."""
    deadline = time.monotonic() + limits.wall_time_s
    assert proc.stdout is not None and proc.stderr is not None
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    ours: LimitKind | None = None
    with selectors.DefaultSelector() as sel:
        for f in out:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map() and ours is None:
            left = deadline - time.monotonic()
            if left <= 0:
                ours = "wall_time"
                break
            for key, _ in sel.select(timeout=min(left, 0.25)):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                out[key.fileobj] += data
                if sum(len(b) for b in out.values()) > limits.output_bytes:
                    ours = "output"
    if ours is None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            ours = "wall_time"
    _kill_group(proc)
    proc.stdout.close()
    proc.stderr.close()
    cap = limits.output_bytes
    return bytes(out[proc.stdout][:cap]), bytes(out[proc.stderr][:cap]), ours


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group, reap the program, then repeat while members remain (a
    fork bomb may add some while we kill; in the namespaces level the PID namespace dies with
    its first process anyway)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(50):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.002)


_PATTERNS: list[tuple[str, LimitKind]] = [
    (r"MemoryError", "memory"),
    (r"\[Errno 27\] File too large", "file_size"),
    (r"BlockingIOError: \[Errno 11\]", "processes"),
]
_REFUSED = re.compile(r"\[sandbox\] write outside the working directory refused|Read-only file system")


def _result(
    rc: int,
    out: bytes,
    err: bytes,
    ours: LimitKind | None,
    limits: SandboxLimits,
    mode: Literal["namespaces", "process"],
    seconds: float,
) -> SandboxResult:
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    sig = -rc if rc < 0 else (rc - 128 if mode == "namespaces" and rc > 128 else 0)
    kind: LimitKind | None = ours
    if kind is None and sig in (signal.SIGXCPU, signal.SIGKILL):
        kind = "cpu_time"
    if kind is None and rc != 0:
        kind = next((k for p, k in _PATTERNS if re.search(p, stderr)), None)
    messages: dict[LimitKind, str] = {
        "wall_time": f"TimeoutError: the program ran longer than {limits.wall_time_s:g} s",
        "cpu_time": f"TimeoutError: the program used more than {limits.cpu_time_s} s of CPU time",
        "memory": f"MemoryError: the program went over its memory limit of {limits.memory_mb} MiB",
        "output": f"OutputLimitExceeded: the program wrote more than {limits.output_bytes} bytes",
        "file_size": f"OSError: the program wrote a file over {limits.file_size_mb} MiB",
        "processes": f"BlockingIOError: the program hit its limit of {limits.processes} processes",
    }
    error = None
    if kind is not None:
        error = messages[kind]
    elif rc != 0:
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        error = lines[-1][:300] if lines else f"the program exited with status {rc}"
        if sig:
            error = f"the program was killed by {signal.Signals(sig).name}"
    return SandboxResult(
        passed=rc == 0 and kind is None,
        returncode=rc,
        error=error,
        stdout=stdout,
        stderr=stderr,
        timed_out=kind == "wall_time",
        killed_by_limit=kind,
        write_outside_refused=bool(_REFUSED.search(stderr)),
        isolation=mode,
        network_isolated=mode == "namespaces",
        seconds=seconds,
    )
