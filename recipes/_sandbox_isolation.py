"""The two isolation levels of `sandbox.run_python`: how each starts a program and cleans up after it.

- namespaces (`namespace_command`): `unshare` new mount, network, PID, IPC and UTS namespaces; a
  shell (root inside them, PID 1 of the new PID namespace) builds a new root file system on a tmpfs
  holding only a read-only runtime view (`runtime_paths`: /usr, the /bin, /sbin, /lib* links or
  directories, the interpreter's installation, /etc/ld.so.cache), a few device nodes, a private
  /proc, and the working directory and /dev/shm, both on one tmpfs of `disk_mb` (the host name
  reads "sandbox"); it
  `pivot_root`s into it, detaches the old root, remounts the new one read-only and runs the
  program through `setpriv` as a fresh unprivileged uid with no capabilities and no_new_privs.
  Host paths, sockets (path-bound ones are not in the view; abstract ones belong to the host's
  network namespace) and SysV IPC are out of reach, and all of it vanishes with the namespaces
  when the run ends.
- process (`drop_privileges`, `remove_traces`): when we are root, the program runs as a fresh
  unprivileged uid/gid with no supplementary groups and no_new_privs, with an interpreter that uid
  can reach (`process_interpreter`); afterwards every process of that uid is killed and its SysV
  IPC objects and its files in the shared temporary directories are removed (by directory
  descriptors, never by a path resolved again after the ownership check). When we are not root
  the program runs as the current user (nothing to drop to) and only its process group is killed.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"  # the program's PATH
_RUNTIME_ROOTS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_RUNTIME_FILES = ("/etc/ld.so.cache",)  # the dynamic loader's index of /usr/lib (not sensitive)
# Where a uid with no rights anywhere else can still create files (sticky, world-writable).
SHARED_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock", "/var/lock")
_PR_SET_NO_NEW_PRIVS = 38
_IPC_RMID = 0


def fresh_uid() -> int:
    """A uid (used as the gid too) that no account and no other run has: 1e9 + a random number."""
    return 1_000_000_000 + secrets.randbelow(1_000_000_000)


def interpreter() -> str:
    """The base interpreter (a venv's python resolves to it; -S does not need the venv)."""
    return os.path.realpath(sys.executable)


def _prefix(exe: str) -> str:
    """The installation `exe` runs from (its binary, shared library and standard library)."""
    prefix = os.path.realpath(sys.base_prefix)
    return prefix if exe.startswith(prefix + os.sep) else str(Path(exe).parent.parent)


# ---- namespaces ---------------------------------------------------------------------------------
_UNSHARE = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]

# Runs as root inside the new namespaces (set -e: any failed step ends the run before the program
# starts). The shell stays PID 1 (no exec) so the program gets ordinary signal handling (PID 1
# ignores SIGXCPU), and the PID namespace, with every process in it, dies when the shell does.
_NS_SCRIPT = r"""
set -eu
set -f
root=$1; uid=$2; disk=$3; runtime=$4; pivot=$5; shift 5
new="$root/newroot"
mkdir -m 0755 "$new"
mount -t tmpfs -o size=4m,mode=0755,nosuid newroot "$new"
expose() {
  mkdir -p "$new${1%/*}"
  if [ -L "$1" ]; then ln -s "$(readlink "$1")" "$new$1"; return; fi
  if [ -d "$1" ]; then mkdir -p "$new$1"; else : > "$new$1"; fi
  mount --bind "$1" "$new$1"
  mount -o remount,bind,ro,nosuid,nodev "$new$1"
}
IFS=:
for p in $runtime; do expose "$p"; done
unset IFS
mkdir -p "$new/dev/shm" "$new/proc" "$new/tmp" "$new$root/work" "$new/.disk"
for d in null zero full random urandom; do
  : > "$new/dev/$d"
  mount --bind "/dev/$d" "$new/dev/$d"
done
ln -s /proc/self/fd "$new/dev/fd"
ln -s /proc/self/fd/0 "$new/dev/stdin"
ln -s /proc/self/fd/1 "$new/dev/stdout"
ln -s /proc/self/fd/2 "$new/dev/stderr"
mount -t proc -o nosuid,nodev,noexec,hidepid=2 proc "$new/proc" 2>/dev/null \
  || mount -t proc -o nosuid,nodev,noexec proc "$new/proc"
printf sandbox > "$new/proc/sys/kernel/hostname"
# One tmpfs of disk_mb holds every writable place (the working directory and /dev/shm), so
# their sum is bounded; its own mount point is removed again, leaving only the two bind mounts.
mount -t tmpfs -o "size=${disk}k,mode=0755,nosuid,nodev" sandbox "$new/.disk"
mkdir -m 0700 "$new/.disk/work"
mkdir -m 1777 "$new/.disk/shm"
cp -R "$root/src/." "$new/.disk/work/"
chown -R "$uid:$uid" "$new/.disk/work"
for pair in "work:$new$root/work" "shm:$new/dev/shm"; do
  mount --bind "$new/.disk/${pair%%:*}" "${pair#*:}"
  mount -o remount,bind,nosuid,nodev "${pair#*:}"
done
umount "$new/.disk"
rmdir "$new/.disk"
cd "$new"
mkdir .old
"$pivot" . .old
umount -l /.old
rmdir /.old
mount -o remount,ro,nosuid /
cd "$root/work"
set +e
setpriv --reuid="$uid" --regid="$uid" --clear-groups --inh-caps=-all --bounding-set=-all \
  --no-new-privs -- "$@"
exit $?
"""


def runtime_paths(exe: str) -> list[str]:
    """What the namespaces level shows of the host, read-only: the runtime roots that exist (kept as
    links where they are links), the interpreter's installation unless one of them holds it, and
    the dynamic loader's cache."""
    roots = [p for p in _RUNTIME_ROOTS if os.path.lexists(p)]
    prefix = _prefix(exe)
    dirs = [p for p in roots if not os.path.islink(p)]
    if not any(prefix == d or prefix.startswith(d + os.sep) for d in dirs):
        roots.append(prefix)
    paths = roots + [p for p in _RUNTIME_FILES if os.path.isfile(p)]
    for p in paths:
        if ":" in p or "\n" in p:
            raise ValueError(f"cannot expose {p!r} to the sandbox (':' or a newline in the path)")
    return paths


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def namespace_command(root: Path, uid: int, disk_mb: int, program: Sequence[str]) -> list[str]:
    """The command that runs `program` (an argv whose first item is an absolute path inside the
    runtime view) at the namespaces level, with `root`/src copied into its working directory."""
    unshare, pivot = _tool("unshare"), _tool("pivot_root")
    if unshare is None or pivot is None:
        raise FileNotFoundError("unshare or pivot_root is not on PATH")
    runtime = ":".join(runtime_paths(program[0]))
    return [unshare, *_UNSHARE, "/bin/sh", "-c", _NS_SCRIPT, "sh", str(root), str(uid), str(disk_mb * 1024),
            runtime, pivot, *program]  # fmt: skip


@functools.cache
def namespaces_available() -> bool:
    """True when the namespaces level works here: Linux, root, util-linux's unshare, setpriv and
    pivot_root on PATH, and a probe run of the interpreter in the sandbox succeeds (once per
    process)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    if not all(_tool(t) for t in ("unshare", "setpriv", "pivot_root", "mount", "umount")):
        return False
    with tempfile.TemporaryDirectory(prefix="freetoken-probe-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)
        (root / "src").mkdir()
        (root / "work").mkdir()
        cmd = namespace_command(root, fresh_uid(), 1, [interpreter(), "-I", "-S", "-c", "pass"])
        env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"}
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=20, env=env, start_new_session=True)
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.info("sandbox: the namespaces probe failed to run: %s", e)
            return False
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"status {done.returncode}"]
        logger.info("sandbox: the namespaces probe failed: %s", why[0])
    return done.returncode == 0


# ---- process level --------------------------------------------------------------------------------
def _reachable_by_others(path: str, *, read: bool = True) -> bool:
    """Whether a uid that owns nothing and is in no group can reach `path` (every directory above it
    searchable by others) and read/execute it."""
    p = Path(path)
    for d in reversed(p.parents):
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(p).st_mode
    need = stat.S_IXOTH | (stat.S_IROTH if read else 0)
    return mode & need == need


def process_interpreter() -> str:
    """The interpreter the process level runs when it drops to a fresh uid: ours when that uid can
    reach it and its standard library, else the system's python of the same version; OSError when
    neither can be used."""
    exe, version = interpreter(), f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [(exe, sysconfig.get_paths()["stdlib"])]
    system = shutil.which(version, path=SANDBOX_PATH)
    if system is not None:
        real = os.path.realpath(system)
        candidates.append((real, str(Path(real).parent.parent / "lib" / version)))
    for candidate, stdlib in candidates:
        try:
            if _reachable_by_others(candidate) and _reachable_by_others(stdlib):
                return candidate
        except OSError:
            continue
    raise OSError(
        f"an unprivileged uid cannot reach {exe} or its standard library (a directory above it is "
        f"closed to others) and there is no system {version}"
    )


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def drop_privileges(uid: int) -> None:
    """In the child, before exec: become `uid`/`uid` with no supplementary groups and set
    no_new_privs (a setuid binary cannot give the program root back). Raises OSError on failure."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


def prepare_drop() -> None:
    """Load libc in the parent, so the child does no dynamic loading between fork and exec."""
    _libc()


def remove_traces(uid: int) -> dict[str, int]:
    """After a process-level run as `uid`: kill every process of that uid, remove its SysV IPC
    objects and its files in `SHARED_TEMP_DIRS`. Returns what was removed, by kind."""
    removed = {"processes": _kill_processes(uid), "ipc": _remove_ipc(uid), "files": _remove_files(uid)}
    if any(removed.values()):
        logger.info("sandbox: removed what uid %d left behind: %s", uid, removed)
    return removed


def _status_uids(pid: str) -> tuple[set[int], bool] | None:
    """(real/effective/saved uids, is a zombie) of a process, or None if it is gone."""
    try:
        text = Path("/proc", pid, "status").read_text()
    except OSError:
        return None
    uids: set[int] = set()
    zombie = False
    for line in text.splitlines():
        if line.startswith("Uid:"):
            uids = {int(x) for x in line.split()[1:4]}
        elif line.startswith("State:"):
            zombie = line.split()[1] in ("Z", "X")
    return uids, zombie


def kill_if_still(pid: str, still: Callable[[], bool]) -> bool:
    """SIGKILL process `pid` if `still()` holds, checked after a pidfd for it is taken: the process
    checked is the one signalled, so a pid reused in between is never hit. True if signalled."""
    try:
        fd = os.pidfd_open(int(pid))
    except OSError:
        return False
    try:
        if still():
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            return True
    except OSError:
        pass
    finally:
        os.close(fd)
    return False


def _live_process_of(pid: str, uid: int) -> bool:
    status = _status_uids(pid)
    return status is not None and uid in status[0] and not status[1]


def _kill_processes(uid: int) -> int:
    """SIGKILL every live process of `uid`, through a pidfd taken before the uid is checked (a pid
    reused in between can never be hit); repeat until none is left (a fork bomb is bounded by
    RLIMIT_NPROC)."""
    killed = 0
    for _ in range(200):
        found = 0
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            still = functools.partial(_live_process_of, pid, uid)
            if still() and kill_if_still(pid, still):  # the first check spares a pidfd per process
                found += 1
        killed += found
        if not found:
            return killed
        time.sleep(0.002)
    logger.warning("sandbox: processes of uid %d still appear after 200 rounds of SIGKILL", uid)
    return killed


def _remove_ipc(uid: int) -> int:
    """Remove the SysV shared memory segments, semaphore sets and message queues `uid` owns or made."""
    libc, removed = _libc(), 0
    for kind, remove in (
        ("shm", lambda i: libc.shmctl(i, _IPC_RMID, None)),
        ("sem", lambda i: libc.semctl(i, 0, _IPC_RMID)),
        ("msg", lambda i: libc.msgctl(i, _IPC_RMID, None)),
    ):
        try:
            lines = Path("/proc/sysvipc", kind).read_text().splitlines()
        except OSError:
            continue
        if not lines:
            continue
        header = lines[0].split()
        at_uid, at_cuid = header.index("uid"), header.index("cuid")
        for line in lines[1:]:
            fields = line.split()
            if int(fields[at_uid]) == uid or int(fields[at_cuid]) == uid:
                removed += remove(int(fields[1])) == 0
    return removed


# The cleanup works on directory descriptors opened with O_NOFOLLOW: a name is checked (lstat) and
# removed relative to the same open directory, never by a path resolved again after the check, so a
# directory swapped for a symlink mid-cleanup cannot move us anywhere else.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_DEPTH = 64  # deeper trees are left (and logged): each level holds one descriptor


def _open_dir(name: str, dir_fd: int | None, expect: os.stat_result | None = None) -> int:
    """Open directory `name` (relative to `dir_fd`) without following a symlink; when `expect` is
    given, refuse (OSError) unless it is still the directory that lstat saw."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    st = os.fstat(fd)
    if expect is not None and (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino):
        os.close(fd)
        raise OSError(errno.ESTALE, "replaced while being cleaned", name)
    return fd


def _remove_tree_at(dir_fd: int, name: str, st: os.stat_result, depth: int) -> None:
    """Remove directory `name` in `dir_fd` (lstat result `st`) and everything in it, by descriptors."""
    if depth > _MAX_DEPTH:
        raise OSError(errno.ELOOP, f"more than {_MAX_DEPTH} levels deep", name)
    fd = _open_dir(name, dir_fd, st)
    try:
        for child in os.listdir(fd):
            child_st = os.stat(child, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(child_st.st_mode):
                _remove_tree_at(fd, child, child_st, depth + 1)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _clean_dir(fd: int, uid: int, where: str, seen: set[tuple[int, int]], depth: int) -> int:
    """Remove the entries `uid` owns in the open directory `fd`; descend into world-writable ones."""
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) in seen or depth > _MAX_DEPTH:
        return 0
    seen.add((st.st_dev, st.st_ino))
    removed = 0
    for name in os.listdir(fd):
        path = os.path.join(where, name)  # for messages only
        try:
            entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if entry.st_uid == uid:
                if stat.S_ISDIR(entry.st_mode):
                    _remove_tree_at(fd, name, entry, depth + 1)
                else:
                    os.unlink(name, dir_fd=fd)  # the link itself for a symlink
                removed += 1
            elif stat.S_ISDIR(entry.st_mode) and entry.st_mode & stat.S_IWOTH:
                sub = _open_dir(name, fd, entry)
                try:
                    removed += _clean_dir(sub, uid, path, seen, depth + 1)
                finally:
                    os.close(sub)
        except OSError as e:
            logger.warning("sandbox: cannot remove %s left by uid %d: %s", path, uid, e)
    return removed


def _remove_files(uid: int) -> int:
    """Remove what `uid` created in the shared temporary directories: entries it owns (whole trees
    for directories, the link itself for symlinks), looking inside world-writable directories only
    (the only other places a uid without rights could create anything)."""
    removed = 0
    seen: set[tuple[int, int]] = set()
    for folder in sorted({os.path.realpath(d) for d in SHARED_TEMP_DIRS if os.path.isdir(d)}):
        try:
            fd = _open_dir(folder, None)
        except OSError:
            continue
        try:
            removed += _clean_dir(fd, uid, folder, seen, 0)
        except OSError as e:
            logger.warning("sandbox: cannot clean %s after uid %d: %s", folder, uid, e)
        finally:
            os.close(fd)
    return removed
