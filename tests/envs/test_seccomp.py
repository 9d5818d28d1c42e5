"""The sandbox's seccomp filter, run by a small classic-BPF interpreter for both architectures
(the hostile suite runs the real one on this machine's)."""

from __future__ import annotations

import struct

import pytest

from megatron_agent.envs.tools import seccomp

ALLOW, EPERM = 0x7FFF0000, 0x00050001
ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# A few calls every interpreter makes, which must stay allowed (x86-64, AArch64 numbers).
EVERYDAY = {
    "x86_64": {"read": 0, "write": 1, "mmap": 9, "clone": 56, "execve": 59, "exit_group": 231},
    "aarch64": {"read": 63, "write": 64, "mmap": 222, "clone": 220, "execve": 221, "exit_group": 94},
}


def run_filter(program: bytes, nr: int, arch: int) -> int:
    """What the filter returns for system call `nr` of `arch` (the opcodes seccomp.py emits)."""
    data = struct.pack("=iI", nr, arch)
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld word at absolute offset
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35):  # jeq / jge
            taken = acc == k if code == 0x15 else acc >= k
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_filter_refuses_exactly_the_memory_calls_and_foreign_abis(machine):
    program = seccomp.filter_program(machine)
    numbers = seccomp._ARCHES[machine][1]
    for name in seccomp.REFUSED:
        assert run_filter(program, numbers[name], ARCH[machine]) == EPERM, name
    for name, nr in EVERYDAY[machine].items():
        assert run_filter(program, nr, ARCH[machine]) == ALLOW, name
    assert run_filter(program, EVERYDAY[machine]["read"], 0x40000003) == EPERM  # i386 ABI
    if machine == "x86_64":
        assert run_filter(program, 0x40000000 | 1, ARCH[machine]) == EPERM  # x32 write
