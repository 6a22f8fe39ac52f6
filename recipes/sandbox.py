"""Run untrusted Python (a model's code and its tests) in a subprocess with limits.

    result = run_python("print(1 + 1)", limits=SandboxLimits(wall_time_s=2))
    result.passed, result.stdout, result.error

Every run: a fresh temporary directory as the working directory, `python -I -S` (no user site,
no site-packages: the standard library only), an environment with nothing of ours in it, stdin
closed, and resource limits set before exec (RLIMIT_AS memory, RLIMIT_CPU, RLIMIT_FSIZE,
RLIMIT_NPROC, RLIMIT_NOFILE, no core files). We SIGKILL the whole run past the wall-time limit or
when stdout + stderr exceed the output cap, and read at most that much output. Model code never
runs as root. `isolation="auto"` logs the level it chose; `isolation="namespaces"` refuses
(SandboxError) to run below that level.

Limits of the whole run (`_sandbox_limits.py`; what a run got is in `SandboxResult.memory_control`
and `.disk_bounded`, and `memory_control()` / `disk_quota_available()` say what this machine gives):
- memory and pids: as root, one cgroup per run (v2 where memory+pids are delegated to us, else v1)
  with `memory_mb` (no swap; tmpfs pages count too) and `processes` (+2 for the namespaces
  level's launcher) for all its processes together; an OOM kill reports the memory limit. Without
  a writable cgroup (not root) only RLIMIT_AS per process and RLIMIT_NPROC per uid hold: a run
  may then use up to memory_mb x processes.
- disk: one tmpfs of `disk_mb` holds every place the run can write: at the namespaces level its
  working directory and /dev/shm; at the process level (root, mount namespaces allowed) its
  working directory and, in a private mount namespace, /tmp, /var/tmp, /dev/shm and /run/lock.
  Otherwise (not root) the working directory is on the host's disk and only RLIMIT_FSIZE (per
  file) bounds writes. Other world-writable places (/dev/mqueue, any the host adds) are not
  covered by the quota.

Kernel-side hardening at both levels (`_sandbox_seccomp.py`, applied in the program's own process
by the boot before its code runs; the program does not run if it cannot be applied): a fresh
session keyring (no key of ours or of an earlier run is reachable) and a seccomp filter that
answers EPERM to new namespaces (unshare, setns, clone with CLONE_NEW*), io_uring, keyctl/add_key/
request_key, ptrace, process_vm_readv/writev, bpf, perf_event_open, userfaultfd, kexec, module
loading, mount/umount/pivot_root/chroot and the new mount API, open_by_handle_at and the
personality flags that disable ASLR/NX, and denies foreign syscall ABIs (i386, x32, arm32). Only
x86_64 and aarch64 have a filter: elsewhere run_python raises SandboxError rather than run
unfiltered. Threads, subprocesses (clone3 answers ENOSYS, libc falls back to clone) and file I/O
are unaffected.

- `namespaces` (Linux, root, util-linux `unshare`, `setpriv`, `pivot_root`; chosen by "auto" when
  a probe run succeeds): new mount, network, PID, IPC and UTS namespaces; the program runs as a
  fresh unprivileged uid with no capabilities and no_new_privs, in a new root file system holding
  only a read-only view of the runtime (/usr, /bin, /lib*, the interpreter's installation), a few
  device nodes, a private /proc, and its working directory and /dev/shm (one tmpfs of `disk_mb`).
  No other host path exists for it (no /etc, /home, /root, /run, /tmp of the host), so no host
  unix socket either; it has no network (a down loopback) and its own SysV IPC. When the run ends
  the namespaces die with every process, segment and file in them.
- `process` (where namespaces are unavailable): as root, the program runs as a fresh unprivileged
  uid/gid with no groups and no_new_privs (with an interpreter that uid can reach, else
  SandboxError: we refuse rather than run as root); afterwards every process of that uid is killed
  and its SysV IPC objects and files in /tmp, /var/tmp, /dev/shm, /dev/mqueue and /run/lock are
  removed (through directory descriptors opened with O_NOFOLLOW, so a directory another run swaps
  for a symlink meanwhile cannot turn the cleanup onto host files). A Python audit hook also refuses
  writes outside the working directory, process creation, sockets and ctypes. What the process level
  does NOT protect: the audit hook is a guard against accidents, not a boundary (PEP 578: native
  code and a few lines of `gc` tricks bypass it); the program then has the network, can connect to
  any host unix socket others may write to (mode 0666), can read every world-readable file, can
  write in any world-writable directory (only the ones above are cleaned) and can see the host's
  processes. Without root there is no uid to drop to: it runs as the current user, with that user's
  rights to files, processes and the network, RLIMIT_NPROC counts all of the user's processes, and
  only its process group is killed afterwards; there is no disk quota and no cgroup (see the limits
  above).

`driver`: a trusted callable run in this process while the program runs, talking to it through a
`SandboxChannel` (length-prefixed JSON on two pipes, fd numbers in the program's environment as
FREETOKEN_SANDBOX_CHANNEL="READ,WRITE"). The coding recipe's test verdict comes through it: the
program only answers calls, this process compares the answers (`_code_judge.py`).

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
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from . import RecipeError
from ._sandbox_channel import SandboxChannel, _Monitor
from ._sandbox_isolation import (
    SANDBOX_PATH,
    drop_privileges,
    fresh_uid,
    interpreter,
    namespace_command,
    namespaces_available,
    prepare_drop,
    process_interpreter,
    remove_traces,
)
from ._sandbox_limits import DiskQuota, MemoryControl, RunCgroup, disk_quota_available, memory_control
from ._sandbox_seccomp import machine_supported

logger = logging.getLogger(__name__)

Isolation = Literal["auto", "namespaces", "process"]
Level = Literal["namespaces", "process"]
_BOOT = Path(__file__).with_name("_sandbox_boot.py")
_HARDENING = Path(__file__).with_name("_sandbox_seccomp.py")  # loaded by the boot, beside it
LimitKind = Literal["wall_time", "cpu_time", "memory", "file_size", "output", "processes"]
CHANNEL_ENV = "FREETOKEN_SANDBOX_CHANNEL"

__all__ = [
    "Isolation",
    "SandboxChannel",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "disk_quota_available",
    "memory_control",
    "namespaces_available",
    "run_python",
]


class SandboxError(RecipeError):
    """Raised when the sandbox cannot run a program at all (not when the program fails): the
    requested isolation level is not available here, the program could not be started, or it
    would have had to run as root."""


class SandboxLimits(BaseModel):
    """Resource limits of one run."""

    model_config = ConfigDict(frozen=True)

    wall_time_s: float = Field(default=5.0, gt=0, description="wall-clock seconds before SIGKILL")
    cpu_time_s: int = Field(default=5, ge=1, description="RLIMIT_CPU seconds (SIGXCPU, then SIGKILL)")
    memory_mb: int = Field(
        default=256, ge=32, description="the whole run's memory (cgroup), and RLIMIT_AS per process, MiB"
    )
    file_size_mb: int = Field(default=8, ge=1, description="RLIMIT_FSIZE: largest file written, MiB")
    disk_mb: int = Field(default=32, ge=1, description="the run's one tmpfs: working dir + temp dirs, MiB")
    processes: int = Field(default=32, ge=1, description="the run's pids (cgroup), RLIMIT_NPROC")
    open_files: int = Field(default=64, ge=16, description="RLIMIT_NOFILE")
    output_bytes: int = Field(default=64_000, ge=1024, description="stdout + stderr cap; SIGKILL past it")
    message_bytes: int = Field(default=1 << 20, ge=1024, description="largest channel message accepted")


class SandboxResult(BaseModel):
    """What a run did. `passed`: exit status 0 and no limit hit (for `check_code`: every test held)."""

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
    isolation: Level
    network_isolated: bool = Field(description="True when the program had no network at all")
    memory_control: MemoryControl = Field(
        default="rlimit", description="memory/pids bounds: one cgroup for the run, or per process"
    )
    disk_bounded: bool = Field(default=False, description="writable places were one tmpfs of disk_mb")
    peak_memory_bytes: int | None = Field(default=None, description="the run's peak memory (cgroup)")
    seconds: float = 0.0


def run_python(
    source: str,
    *,
    files: Mapping[str, str] | None = None,
    limits: SandboxLimits | None = None,
    isolation: Isolation = "auto",
    args: Sequence[str] = (),
    driver: Callable[[SandboxChannel], None] | None = None,
) -> SandboxResult:
    """Run `source` as `main.py` (with `files`, name -> text, beside it) in a fresh sandbox.

    `driver` (optional) runs here while the program runs, with the program's channel; the program's
    end of it closes when the driver returns. Raises SandboxError when `isolation` names a level
    this machine cannot provide, or when the program would run as root; ValueError for a file
    name that is not a plain name."""
    limits = limits or SandboxLimits()
    level = _resolve(isolation)
    if not machine_supported():  # the boot would refuse too; say why before starting anything
        raise SandboxError(
            "the sandbox has no seccomp filter for this machine's architecture; it will not run unfiltered"
        )
    for name in files or {}:
        if Path(name).name != name or name in (_BOOT.name, _HARDENING.name, "main.py", "", ".", ".."):
            raise ValueError(
                f"sandbox file names must be plain names "
                f"(not main.py, {_BOOT.name}, {_HARDENING.name}): {name!r}"
            )
    uid = fresh_uid() if level == "namespaces" or os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory(prefix="freetoken-sandbox-") as tmp:
        root = Path(tmp)
        work, src = root / "work", root / "src"
        work.mkdir()
        src.mkdir()
        for name, text in {**(files or {}), "main.py": source}.items():
            (src / name).write_text(text)
        shutil.copyfile(_BOOT, src / _BOOT.name)
        shutil.copyfile(_HARDENING, src / _HARDENING.name)
        os.chmod(root, 0o755)  # the sandbox uid must reach its working directory
        quota = None
        try:
            if level == "process" and uid is not None and disk_quota_available():
                quota = DiskQuota(root, limits.disk_mb, uid)  # the working dir and temp dirs, one tmpfs
                work = quota.work
            if level == "namespaces":
                assert uid is not None
                program = [interpreter(), "-I", "-S", _BOOT.name, "report", "main.py", *args]
                cmd, drop = namespace_command(root, uid, limits.disk_mb, program), None
            else:
                cmd, drop = _process_command(work, src, uid, args), uid
            logger.debug("sandbox run (%s isolation) in %s", level, work)
            result = _run(cmd, work, limits, level, drop, driver, quota)
        finally:
            if level == "process" and uid is not None:
                remove_traces(uid)
            if quota is not None:
                quota.close()
    return result


def _process_command(work: Path, src: Path, uid: int | None, args: Sequence[str]) -> list[str]:
    exe = interpreter()
    shutil.copytree(src, work, dirs_exist_ok=True)
    if uid is not None:
        try:
            exe = process_interpreter()
        except OSError as e:
            raise SandboxError(f"the process level will not run model code as root, and {e}") from e
        prepare_drop()
        for path in [work, *work.rglob("*")]:
            os.chown(path, uid, uid, follow_symlinks=False)
    return [exe, "-I", "-S", _BOOT.name, "guard", "main.py", *args]


def _run(
    cmd: list[str],
    work: Path,
    limits: SandboxLimits,
    level: Level,
    drop: int | None,
    driver: Callable[[SandboxChannel], None] | None,
    quota: DiskQuota | None = None,
) -> SandboxResult:
    env = _environment()
    # namespaces: `unshare` and the PID-1 shell are in the run's cgroup too
    cgroup = RunCgroup.create(limits.memory_mb, limits.processes + (2 if level == "namespaces" else 0))
    disk = "one tmpfs" if quota is not None or level == "namespaces" else "per file only (RLIMIT_FSIZE)"
    logger.info("sandbox: memory/pids bounded by %s, disk by %s", cgroup.control, disk)
    ours: list[int] = []  # our ends of the channel pipes
    theirs: list[int] = []
    if driver is not None:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        ours, theirs = [to_w, from_r], [to_r, from_w]
        env[CHANNEL_ENV] = f"{to_r},{from_w}"
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            preexec_fn=functools.partial(_prepare_child, limits, drop, cgroup, quota),
            start_new_session=True,
            close_fds=True,
            pass_fds=theirs,
        )
    except (OSError, subprocess.SubprocessError) as e:
        for fd in ours + theirs:
            os.close(fd)
        cgroup.close()
        raise SandboxError(f"cannot start the sandbox ({cmd[0]}): {e}") from e
    for fd in theirs:
        os.close(fd)
    cgroup.close_fds()
    to_program, from_program = ours or (None, None)
    monitor = _Monitor(
        proc, limits.wall_time_s, limits.output_bytes, limits.message_bytes, to_program, from_program
    )
    try:
        if driver is not None:
            driver(SandboxChannel(monitor))
        stdout, stderr, limit = monitor.finish()
    finally:
        monitor.close()
        _kill_group(proc)
        cgroup.close()  # kills what the process group missed (a child that called setsid)
    result = _result(proc.returncode, stdout, stderr, limit, limits, level, time.perf_counter() - t0, cgroup)
    return result.model_copy(update={"disk_bounded": quota is not None or level == "namespaces"})


def _resolve(isolation: Isolation) -> Level:
    if isolation not in ("auto", "namespaces", "process"):
        raise ValueError(f"isolation must be 'auto', 'namespaces' or 'process', got {isolation!r}")
    if isolation == "process":
        level: Level = "process"
    elif namespaces_available():
        level = "namespaces"
    elif isolation == "namespaces":
        raise SandboxError(
            "isolation='namespaces' needs Linux, root and util-linux's unshare, setpriv and pivot_root, "
            "and they did not work here; isolation='process' runs with less protection (see the sandbox docs)"
        )
    else:
        level = "process"
        _warn_fallback()
    logger.info("sandbox: %s isolation (asked for %r)", level, isolation)
    return level


@functools.cache
def _warn_fallback() -> None:
    logger.warning(
        "sandbox: namespaces are unavailable here; 'auto' runs model code at the weaker process level "
        "(an unprivileged uid when root; network and world-readable files stay reachable)"
    )


# ---- limits and environment ----------------------------------------------------------------------
def _prepare_child(
    limits: SandboxLimits, drop: int | None, cgroup: RunCgroup | None = None, quota: DiskQuota | None = None
) -> None:
    """preexec_fn: runs in the child between fork and exec: into the run's cgroup and (process level)
    its private temp dirs while still root, the limits, then (as root at the process level) the
    switch to the unprivileged uid."""
    if cgroup is not None:
        cgroup.join()
    if quota is not None:
        quota.enter()
    mib = 1 << 20
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mib, limits.memory_mb * mib))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_time_s, limits.cpu_time_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_mb * mib, limits.file_size_mb * mib))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if drop is not None:
        drop_privileges(drop)


def _environment() -> dict[str, str]:
    """A scrubbed environment: none of ours (no tokens, no proxies, no PYTHONPATH)."""
    return {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/nonexistent"}


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


# ---- results --------------------------------------------------------------------------------------
_PATTERNS: list[tuple[str, LimitKind]] = [
    (r"MemoryError", "memory"),
    (r"\[Errno 27\] File too large", "file_size"),
    (r"BlockingIOError: \[Errno 11\]", "processes"),
]
_REFUSED = re.compile(r"\[sandbox\] write outside the working directory refused|Read-only file system")


def limit_message(kind: LimitKind, limits: SandboxLimits) -> str:
    """The one-line error of a run stopped by limit `kind` (the embedded model's training format)."""
    return {
        "wall_time": f"TimeoutError: the program ran longer than {limits.wall_time_s:g} s",
        "cpu_time": f"TimeoutError: the program used more than {limits.cpu_time_s} s of CPU time",
        "memory": f"MemoryError: the program went over its memory limit of {limits.memory_mb} MiB",
        "output": f"OutputLimitExceeded: the program wrote more than {limits.output_bytes} bytes",
        "file_size": f"OSError: the program wrote a file over {limits.file_size_mb} MiB",
        "processes": f"BlockingIOError: the program hit its limit of {limits.processes} processes",
    }[kind]


def _result(
    rc: int,
    out: bytes,
    err: bytes,
    ours: LimitKind | None,
    limits: SandboxLimits,
    level: Level,
    seconds: float,
    cgroup: RunCgroup | None = None,
) -> SandboxResult:
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    sig = -rc if rc < 0 else (rc - 128 if level == "namespaces" and rc > 128 else 0)
    kind: LimitKind | None = ours
    if kind is None and cgroup is not None and cgroup.oom_killed():
        kind = "memory"  # the kernel's OOM killer sends SIGKILL too: check it before RLIMIT_CPU's
    if kind is None and rc != 0 and cgroup is not None and cgroup.pids_refused():
        kind = "processes"
    if kind is None and sig in (signal.SIGXCPU, signal.SIGKILL):
        kind = "cpu_time"
    if kind is None and rc != 0:
        kind = next((k for p, k in _PATTERNS if re.search(p, stderr)), None)
    error = None
    if kind is not None:
        error = limit_message(kind, limits)
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
        isolation=level,
        network_isolated=level == "namespaces",
        memory_control=cgroup.control if cgroup is not None else "rlimit",
        peak_memory_bytes=cgroup.peak_memory() if cgroup is not None else None,
        seconds=seconds,
    )
