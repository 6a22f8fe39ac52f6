"""Limits of a whole sandbox run (not of each process): one memory and pid budget, one disk quota.

Memory and pids (`RunCgroup`): a child cgroup per run, made under this process's own cgroup, that
the program's first process joins between fork and exec (so all its descendants are in it):
- `cgroup2`: memory.max, memory.swap.max=0, pids.max (needs the memory and pids controllers
  enabled for our cgroup's children, e.g. a delegated subtree);
- `cgroup1`: memory.limit_in_bytes (+ memory.memsw.limit_in_bytes: no swap) and pids.max in the
  v1 memory and pids hierarchies;
- `rlimit`: neither is writable here (not root, no delegation): only the per-process RLIMIT_AS and
  the per-uid RLIMIT_NPROC hold, so a run may use up to memory_mb x processes. The weaker fallback.
tmpfs pages written by the run are charged to its cgroup too. After the run every process left
in the cgroup is killed (cgroup.kill, else by pid) and the cgroup removed.

Disk (`DiskQuota`): the process level's writable places as one tmpfs of `disk_mb`, mounted by
root for the run: the working directory, and, in a private mount namespace of the program,
/tmp, /var/tmp, /dev/shm and /run/lock (bind mounts of its subdirectories), so their sum is
bounded. The namespaces level does the same inside its own mount namespace (`_sandbox_isolation`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Literal

from ._sandbox_isolation import kill_if_still

logger = logging.getLogger(__name__)

MemoryControl = Literal["cgroup2", "cgroup1", "rlimit"]
_CGROUP = Path("/sys/fs/cgroup")
_MIB = 1 << 20
# Shared temporary dirs the process level hides behind the run's tmpfs (a symlink such as
# /var/lock -> /run/lock is covered through its target).
PRIVATE_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_MNT_DETACH = 2


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path in the hierarchy of `controller` ("" for the v2 unified one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path
    return None


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _counter(path: Path, key: str) -> int:
    """`key`'s value in a flat-keyed cgroup file (memory.events, pids.events, memory.oom_control)."""
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


class RunCgroup:
    """The cgroup(s) of one run. `create` picks the best level this machine allows; `join` runs in
    the child before exec; `close` kills what is left and removes the cgroup(s)."""

    def __init__(self, control: MemoryControl, dirs: list[Path]) -> None:
        self.control = control
        self.dirs = dirs  # v2: [the cgroup]; v1: [memory cgroup, pids cgroup]; rlimit: []
        self._procs = [os.open(d / "cgroup.procs", os.O_WRONLY) for d in dirs]
        self._final: tuple[bool, bool, int | None] | None = None  # read before the cgroup is removed

    @classmethod
    def create(cls, memory_mb: int, pids: int) -> RunCgroup:
        name = f"freetoken-sandbox-{secrets.token_hex(6)}"
        for make in (_make_v2, _make_v1):
            try:
                dirs = make(name, memory_mb * _MIB, pids)
            except OSError as e:
                logger.debug("sandbox: %s: %s", make.__name__, e)
                continue
            if dirs:
                control: MemoryControl = "cgroup2" if make is _make_v2 else "cgroup1"
                return cls(control, dirs)
        _warn_rlimit_only()
        return cls("rlimit", [])

    def join(self) -> None:
        """In the child, between fork and exec: move this process into the run's cgroup(s)."""
        pid = str(os.getpid()).encode()
        for fd in self._procs:
            os.write(fd, pid)

    def close_fds(self) -> None:
        for fd in self._procs:
            os.close(fd)
        self._procs = []

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for going over the memory limit."""
        if self._final is not None:
            return self._final[0]
        if self.control == "cgroup2":
            return _counter(self.dirs[0] / "memory.events", "oom_kill") > 0
        if self.control == "cgroup1":
            return _counter(self.dirs[0] / "memory.oom_control", "oom_kill") > 0
        return False

    def pids_refused(self) -> bool:
        """Whether a fork was refused at the run's pid limit."""
        if self._final is not None:
            return self._final[1]
        if not self.dirs:
            return False
        return _counter(self.dirs[-1] / "pids.events", "max") > 0

    def peak_memory(self) -> int | None:
        """The most memory (bytes) the run's processes and tmpfs pages held at once, if known."""
        if self._final is not None:
            return self._final[2]
        name = {"cgroup2": "memory.peak", "cgroup1": "memory.max_usage_in_bytes"}.get(self.control)
        if name is None:
            return None
        try:
            return int((self.dirs[0] / name).read_text())
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        """Kill every process left in the run's cgroup(s), then remove them."""
        self.close_fds()
        if self._final is None:
            self._final = (self.oom_killed(), self.pids_refused(), self.peak_memory())
        for d in self.dirs:
            with contextlib.suppress(OSError):
                _write(d / "cgroup.kill", "1")  # v2 (5.14+): atomic, no pid races
            for _ in range(200):
                if not _kill_members(d):
                    break
                time.sleep(0.002)
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)  # the last members are still exiting
            else:
                logger.warning("sandbox: cannot remove the run's cgroup %s", d)


def _kill_members(cgroup: Path) -> int:
    """SIGKILL the processes listed in `cgroup`, through a pidfd taken before the pid is checked to
    still be a member (a reused pid is never hit). Returns how many were signalled."""
    try:
        pids = (cgroup / "cgroup.procs").read_text().split()
    except OSError:
        return 0
    return sum(kill_if_still(pid, functools.partial(_is_member, cgroup, pid)) for pid in pids)


def _is_member(cgroup: Path, pid: str) -> bool:
    return pid in (cgroup / "cgroup.procs").read_text().split()


def _make_v2(name: str, memory: int, pids: int) -> list[Path]:
    own = _own_cgroup("")
    parent = _CGROUP / own.lstrip("/") if own is not None else None
    if parent is None or not (parent / "cgroup.subtree_control").is_file():
        return []
    if not {"memory", "pids"} <= set((parent / "cgroup.subtree_control").read_text().split()):
        return []  # enabling them here would need our own cgroup to hold no process
    d = parent / name
    d.mkdir(mode=0o755)
    try:
        _write(d / "memory.max", str(memory))
        _write(d / "memory.swap.max", "0")
        _write(d / "pids.max", str(pids))
    except OSError:
        d.rmdir()
        raise
    return [d]


def _make_v1(name: str, memory: int, pids: int) -> list[Path]:
    made: list[Path] = []
    try:
        for controller in ("memory", "pids"):
            own = _own_cgroup(controller)
            root = _CGROUP / controller
            if own is None or not (root / "cgroup.procs").is_file():
                raise FileNotFoundError(f"no cgroup v1 {controller} hierarchy")
            d = root / own.lstrip("/") / name
            d.mkdir(mode=0o755)
            made.append(d)
        mem, pid = made
        _write(mem / "memory.limit_in_bytes", str(memory))
        if (mem / "memory.memsw.limit_in_bytes").exists():
            _write(mem / "memory.memsw.limit_in_bytes", str(memory))
        _write(pid / "pids.max", str(pids))
    except OSError:
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return made


@functools.cache
def _warn_rlimit_only() -> None:
    logger.warning(
        "sandbox: no writable cgroup (v2 with memory+pids delegated, or v1) here: memory is bounded only "
        "per process (RLIMIT_AS), so a run may use up to memory_mb x processes"
    )


def memory_control() -> MemoryControl:
    """The memory/pid control a run gets on this machine now ('cgroup2', 'cgroup1' or 'rlimit')."""
    probe = RunCgroup.create(64, 8)
    probe.close()
    return probe.control


# ---- disk -----------------------------------------------------------------------------------------
@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


class DiskQuota:
    """One tmpfs of `disk_mb` for a process-level run, mounted by root at `root`/disk: `work` (the
    program's working directory, owned by `uid`) and one directory per `PRIVATE_TEMP_DIRS` entry,
    which `enter` (in the child) binds over those paths in a private mount namespace."""

    def __init__(self, root: Path, disk_mb: int, uid: int | None) -> None:
        self.mount = root / "disk"
        self.mount.mkdir(mode=0o755)
        options = f"size={disk_mb * 1024}k,mode=0755".encode()
        libc = _libc()
        _check(libc.mount(b"freetoken-sandbox", bytes(self.mount), b"tmpfs", _MS_NOSUID | _MS_NODEV, options),
               "mount tmpfs")  # fmt: skip
        try:
            self._layout(uid)
        except OSError:
            self.close()
            raise
        _libc()  # loaded here, so the child does no dynamic loading between fork and exec

    def _layout(self, uid: int | None) -> None:
        self.work = self.mount / "work"
        self.work.mkdir(mode=0o700)
        if uid is not None:
            os.chown(self.work, uid, uid)
        self.binds: list[tuple[bytes, bytes]] = []
        for i, target in enumerate(PRIVATE_TEMP_DIRS):
            real = os.path.realpath(target)
            if not os.path.isdir(real) or any(real == t for _, t in self.binds):
                continue
            source = self.mount / f"temp{i}"
            source.mkdir()
            os.chmod(source, 0o1777)
            self.binds.append((bytes(source), real.encode()))
        # The working directory's path must stay valid once its temp dir is covered: recreate it
        # inside the private one and bind the working directory there (carried by the recursive bind).
        work = os.path.realpath(self.work)
        for source, target in list(self.binds):
            top = os.fsdecode(target)
            if work.startswith(top + os.sep):
                base, rel = Path(os.fsdecode(source)), Path(os.path.relpath(work, top))
                (base / rel).mkdir(parents=True)
                for d in (rel, *rel.parents[:-1]):
                    os.chmod(base / d, 0o755)  # the program's uid must pass, whatever our umask
                self.binds.insert(0, (bytes(self.work), bytes(base / rel)))
                break
        # Sources live under a temp dir too (the tmpfs is mounted in /tmp): cover that one last.
        mount = os.path.realpath(self.mount).encode()
        self.binds.sort(key=lambda pair: mount.startswith(pair[1] + b"/"))
        self._work = work.encode()

    def enter(self) -> None:
        """In the child, as root, before exec: a private mount namespace where the shared temp dirs
        are this run's directories, then back into the working directory by its path."""
        libc = _libc()
        _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
        for source, target in self.binds:
            _check(libc.mount(source, target, None, _MS_BIND | _MS_REC, None), "bind mount")
        os.chdir(self._work)

    def close(self) -> None:
        """Unmount the tmpfs (lazily: the program's mount namespace may still hold it a moment)."""
        with contextlib.suppress(OSError):
            _check(_libc().umount2(bytes(self.mount), _MNT_DETACH), "umount")
        with contextlib.suppress(OSError):
            self.mount.rmdir()


@functools.cache
def disk_quota_available() -> bool:
    """Whether the process level can mount its tmpfs and enter a private mount namespace here
    (root, CAP_SYS_ADMIN, unshare allowed): a probe run, once per process."""
    if os.geteuid() != 0 or not Path("/proc/self/ns/mnt").exists():
        return False
    import tempfile

    with tempfile.TemporaryDirectory(prefix="freetoken-probe-") as tmp:
        try:
            quota = DiskQuota(Path(tmp), 1, None)
        except OSError as e:
            logger.info("sandbox: the process level cannot mount a tmpfs here (%s): disk is not bounded", e)
            return False
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", ":"], preexec_fn=quota.enter, capture_output=True, timeout=20
            )
            ok = done.returncode == 0
        except (OSError, subprocess.SubprocessError) as e:
            logger.info("sandbox: the process level cannot enter a mount namespace here (%s)", e)
            ok = False
        finally:
            quota.close()
            shutil.rmtree(quota.mount, ignore_errors=True)
    return ok
