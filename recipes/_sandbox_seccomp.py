"""Kernel-side hardening of the sandboxed program's own process: a fresh session keyring and a
seccomp filter, installed by `_sandbox_boot.py` before the program's code runs (both levels).

The sandboxed interpreter runs `python -I -S` with the standard library only, so this file is
stdlib-only (ctypes + struct) and is copied next to the boot file and loaded from there by path.

The filter (classic BPF, `build_filter`) answers EPERM, never a kill, so a program gets a clean
`PermissionError`, for the calls a sandboxed program has no use for and that widen the kernel's
attack surface or reach outside the run: new namespaces (unshare, setns, clone with a CLONE_NEW*
flag), io_uring, the key management calls (keyctl, add_key, request_key), ptrace and cross-process
memory access, bpf, perf_event_open, userfaultfd, kexec, module loading, mounts (old and new API),
chroot, file handles (open_by_handle_at), swap/reboot/acct/quotactl/syslog/iopl/ioperm and the
personality flags that turn off ASLR or NX. clone3 gets ENOSYS (its flags sit behind a pointer the
filter cannot read; libc then falls back to clone, whose flags it can). A foreign syscall ABI (i386
or x32 on x86_64, arm32 on aarch64) is denied as a whole. Only x86_64 and aarch64 are known: on any
other machine `install` raises `SeccompUnsupported` rather than run the program unfiltered.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

__all__ = ["SeccompUnsupported", "build_filter", "install", "join_fresh_session_keyring", "machine_supported"]


class SeccompUnsupported(OSError):
    """This machine's architecture has no filter here (or the kernel refused to install it)."""


_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000

# Syscall numbers denied outright (EPERM), per architecture.
_DENIED = {
    "x86_64": {
        "unshare": 272, "setns": 308, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249, "ptrace": 101,
        "process_vm_readv": 310, "process_vm_writev": 311, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "mount": 165, "umount2": 166, "pivot_root": 155,
        "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "name_to_handle_at": 303,
        "open_by_handle_at": 304, "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163,
        "quotactl": 179, "syslog": 103, "iopl": 172, "ioperm": 173, "lookup_dcookie": 212,
        "vhangup": 153,
    },
    "aarch64": {
        "unshare": 97, "setns": 268, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "keyctl": 219, "add_key": 217, "request_key": 218, "ptrace": 117,
        "process_vm_readv": 270, "process_vm_writev": 271, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "mount": 40, "umount2": 39, "pivot_root": 41,
        "chroot": 51, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "name_to_handle_at": 264,
        "open_by_handle_at": 265, "swapon": 224, "swapoff": 225, "reboot": 142, "acct": 89,
        "quotactl": 60, "syslog": 116, "lookup_dcookie": 18, "vhangup": 58,
    },
}  # fmt: skip
# Calls whose arguments decide: clone (namespace flags), clone3 (ENOSYS), personality.
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435
_PERSONALITY = {"x86_64": 135, "aarch64": 92}
_KEYCTL = {"x86_64": 250, "aarch64": 219}

# CLONE_NEWTIME | CLONE_NEWNS | CLONE_NEWCGROUP | UTS | IPC | USER | PID | NET
_CLONE_NEW_FLAGS = 0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
_CLONE_NEW_FLAGS |= 0x40000000
# personality(2) values a normal program uses: PER_LINUX, PER_LINUX32, UNAME26 variants, the query.
_PERSONALITY_OK = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

# Classic BPF (linux/filter.h, linux/seccomp.h).
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LOW = 0, 4, 16  # struct seccomp_data (args are little-endian u64 here)
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_KEYCTL_JOIN_SESSION_KEYRING = 1


def machine_supported(machine: str | None = None) -> bool:
    """Whether a filter exists for `machine` (default: this one)."""
    return (machine or platform.machine()) in _AUDIT_ARCH


def build_filter(machine: str | None = None) -> bytes:
    """The filter for `machine` (default: this one) as packed `struct sock_filter`s."""
    arch = machine or platform.machine()
    if arch not in _AUDIT_ARCH:
        raise SeccompUnsupported(errno.ENOSYS, f"no seccomp filter for the {arch!r} architecture")
    prog: list[tuple[int, int | str, int | str, int]] = [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, 0, "deny", _AUDIT_ARCH[arch]),
        (_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    if arch == "x86_64":
        prog.append((_JSET_K, "deny", 0, _X32_BIT))
    prog += [(_JEQ_K, "deny", 0, nr) for nr in sorted(_DENIED[arch].values())]
    prog += [
        (_JEQ_K, "clone", 0, _CLONE[arch]),
        (_JEQ_K, "enosys", 0, _CLONE3),
        (_JEQ_K, "personality", 0, _PERSONALITY[arch]),
        (_RET_K, 0, 0, _RET_ALLOW),
        "clone",
        (_LD_W_ABS, 0, 0, _OFF_ARG0_LOW),
        (_JSET_K, "deny", "allow", _CLONE_NEW_FLAGS),
        "personality",
        (_LD_W_ABS, 0, 0, _OFF_ARG0_LOW),
        *[(_JEQ_K, "allow", 0, value) for value in _PERSONALITY_OK],
        "deny",
        (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM),
        "enosys",
        (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),
        "allow",
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    return _assemble(prog)


def _assemble(prog: list) -> bytes:
    """Resolve the string labels in `prog` into the relative jumps of classic BPF (0..255 ahead)."""
    labels, code = {}, []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(code)
        else:
            code.append(item)
    out = b""
    for i, (op, jt, jf, k) in enumerate(code):
        jumps = [labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf)]
        if not all(0 <= j <= 255 for j in jumps):
            raise ValueError(f"seccomp filter jump out of range at instruction {i}")
        out += struct.pack("=HBBI", op, jumps[0], jumps[1], k)
    return out


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def join_fresh_session_keyring() -> bool:
    """Give this process a new anonymous session keyring, so no key of the caller's session (or of
    an earlier run) is reachable; False when the kernel has no keyrings."""
    arch = platform.machine()
    if arch not in _KEYCTL:
        return False
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(_KEYCTL[arch]), ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING), None) >= 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):  # no keyrings, or a filter above us already denies them
        return False
    raise OSError(err, "keyctl(KEYCTL_JOIN_SESSION_KEYRING) failed")


def install() -> None:
    """Set no_new_privs and install the filter on this (single-threaded) process; everything it
    execs or forks inherits it. Raises SeccompUnsupported when it cannot be installed."""
    code = build_filter()
    libc = _libc()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise SeccompUnsupported(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise SeccompUnsupported(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) refused the filter")
