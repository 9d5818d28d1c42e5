"""A seccomp filter for the sandbox: the system calls that make memory no per-process limit sees.

Address-space limits count what a process maps, but three kinds of memory outlive any mapping:
an anonymous memory file (`memfd_create`, filled with `write`), a System V shared-memory segment
(`shmget`, kept by the IPC namespace after `shmdt`) and a System V message queue (`msgget`).
Without a cgroup (the rlimit path) nothing would bound them, so the sandbox refuses these calls
(EPERM: Python raises PermissionError). Files in the size-limited tmpfs (/dev/shm included) are
the way a snippet shares memory.

The filter is classic BPF, as bubblewrap's `--seccomp FD` reads it (an array of `struct
sock_filter`), built here with the standard library for x86-64 and AArch64. A call made through
another ABI (i386 or x32 on x86-64) is refused whatever it is.
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# struct seccomp_data: int nr; __u32 arch; ...
_NR_OFFSET, _ARCH_OFFSET = 0, 4
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW = 0x7FFF0000
_RET_EPERM = 0x00050000 | errno.EPERM
_X32_SYSCALL_BIT = 0x40000000

REFUSED = ("shmget", "msgget", "memfd_create", "memfd_secret")
_ARCHES = {  # machine -> (AUDIT_ARCH_*, system call numbers of REFUSED)
    "x86_64": (0xC000003E, {"shmget": 29, "msgget": 68, "memfd_create": 319, "memfd_secret": 447}),
    "aarch64": (0xC00000B7, {"shmget": 194, "msgget": 186, "memfd_create": 279, "memfd_secret": 447}),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def supported() -> bool:
    """Whether this machine's architecture has a filter here."""
    return platform.machine() in _ARCHES


def filter_program(machine: str | None = None) -> bytes:
    """The compiled filter for `machine` (default this one): EPERM for `REFUSED` and for any
    foreign ABI, everything else allowed."""
    arch, numbers = _ARCHES[machine or platform.machine()]
    body = [_insn(_LD_W_ABS, _NR_OFFSET)]
    if arch == _ARCHES["x86_64"][0]:
        body.append(("jge", _X32_SYSCALL_BIT))
    body += [("jeq", numbers[name]) for name in REFUSED]
    # Layout: load arch; arch check; body...; ret allow; ret eperm (the target of every match).
    program = [_insn(_LD_W_ABS, _ARCH_OFFSET)]
    program.append(_insn(_JEQ_K, arch, jt=0, jf=len(body) + 1))
    for i, insn in enumerate(body):
        if isinstance(insn, bytes):
            program.append(insn)
            continue
        kind, k = insn
        to_eperm = len(body) - i  # skips the rest of the body and the allow
        program.append(_insn(_JGE_K if kind == "jge" else _JEQ_K, k, jt=to_eperm, jf=0))
    program += [_insn(_RET_K, _RET_ALLOW), _insn(_RET_K, _RET_EPERM)]
    return b"".join(program)


def filter_fd() -> int:
    """A file descriptor holding this machine's filter, for `bwrap --seccomp FD` (the caller
    closes it)."""
    fd = os.memfd_create("seccomp")
    os.write(fd, filter_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
