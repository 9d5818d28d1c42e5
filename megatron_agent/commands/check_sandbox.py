"""`python -m megatron_agent check-sandbox [--config FILE] [key=value ...]`: whether the python
tool's sandbox holds a call on this machine, with a run's settings.

Builds the python tool as a rollout engine of that run would here (`tools.python.*`,
`tools.max_concurrent`, `rollout.num_engines` on a local cluster), runs one snippet through it and
prints one line: the path that holds a call (bwrap+cgroup, bwrap+rlimit, off+...), the limits and
the worst case against this machine's available memory. Exit 0 when the run's python tool can
start here (also when the config does not enable the python tool: nothing to hold), 2 with what is
missing and the two ways out otherwise. The Slurm launcher runs it on every node before Ray starts
(examples/slurm/ray_launch.sh, SANDBOX_CHECK).
"""

from __future__ import annotations

import asyncio
import socket

from megatron_agent.commands.train import load
from megatron_agent.errors import InputError, RunFailure


def main(argv: list[str]) -> int:
    """Check the sandbox; returns the exit status (an unusable sandbox raises an InputError)."""
    from megatron_agent.envs.tools.python import SHM_MB
    from megatron_agent.platform.free_memory import available_memory_bytes
    from megatron_agent.rollout.factory import build_toolset

    cfg = load("python -m megatron_agent check-sandbox", argv, __doc__)
    host, needed = socket.gethostname(), "python" in cfg.tools.enabled
    try:
        tools = build_toolset(cfg, ["python"])
    except InputError as exc:
        if needed:
            raise
        print(
            f"sandbox on {host}: not usable ({exc}); the config does not enable the python tool, so the run does not need it"
        )
        return 0
    tool = tools.tools["python"]
    result = asyncio.run(tools.run("python", {"code": "print(6 * 7)"}))
    if result.text != "42\n":
        raise RunFailure(
            f"sandbox on {host}: {tool.path} started, but a snippet did not run: {result.text[-500:]}"
        )
    worst = tool.max_concurrent * tool.memory_mb
    print(
        f"sandbox on {host}: {tool.path}; per call {tool.memory_mb} MiB (working folder {tool.tmp_mb} MiB, "
        f"/dev/shm {SHM_MB} MiB), {tool.max_processes} processes, {tool.timeout_s:g} s; "
        f"{tool.max_concurrent} calls at once: {worst} MiB at worst of "
        f"{available_memory_bytes() >> 20} MiB available"
        + ("" if needed else " (the config does not enable the python tool)")
    )
    return 0
