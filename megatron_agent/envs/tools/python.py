"""`python`: run a snippet in a subprocess with time, memory and output limits and no network.

Isolation, honestly stated: the snippet runs as a separate `python -I` process in a fresh
temporary working folder (deleted afterwards) with a minimal environment, under
`RLIMIT_AS` (memory), `RLIMIT_CPU`, `RLIMIT_FSIZE` (file size) and a wall-clock timeout that kills
its whole process group. Network: when `unshare -n` works on the machine (root, or unprivileged
user namespaces enabled) the process gets an empty network namespace (no interfaces besides a
down loopback). Where it does not, the tool still runs but `network_isolated` is False and a
warning is logged once: it is then NOT a sandbox against network access or reading files the
user can read. It is never a security boundary against a hostile model; use a container for that.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import subprocess
import sys
import tempfile

from megatron_agent.envs.tools.base import Tool

logger = logging.getLogger(__name__)


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare -n` can create a network namespace here."""
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _limits(memory_bytes: int, cpu_s: int, file_bytes: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


class Python(Tool):
    """Run Python code; returns what it prints (stdout and stderr)."""

    name = "python"
    description = "Run a Python 3 snippet and return its printed output. No network, no state between calls."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source; print the result"}},
        "required": ["code"],
    }

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 64 * 1024):
        """Limits: wall and CPU time `timeout_s`, address space `memory_mb`, captured output."""
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.network_isolated = network_namespace_available()
        if not self.network_isolated:
            logger.warning(
                "python tool: `unshare -n` is not available here; snippets are NOT cut off from the network"
            )

    async def call(self, code: str) -> bytes:
        """Run `code`; raises on a non-zero exit with the output in the message."""
        with tempfile.TemporaryDirectory(prefix="ma_python_") as workdir:
            script = os.path.join(workdir, "main.py")
            with open(script, "w") as f:
                f.write(code)
            argv = [sys.executable, "-I", "-B", script]
            if self.network_isolated:
                argv = ["unshare", "-n"] + argv
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8"}
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=workdir,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_limits(self.memory_mb << 20, max(1, int(self.timeout_s) + 1), 16 << 20),
                start_new_session=True,
            )
            try:
                output = await self._read_capped(proc)
                await proc.wait()
            finally:
                if proc.returncode is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    await proc.wait()
        if proc.returncode != 0:
            tail = output[-2000:].decode("utf-8", errors="replace")
            raise RuntimeError(f"exit status {proc.returncode}\n{tail}")
        return output

    async def _read_capped(self, proc) -> bytes:
        """Read all output, keeping the first `max_output_bytes` (the rest is drained and dropped)."""
        kept = bytearray()
        while True:
            chunk = await proc.stdout.read(65536)
            if not chunk:
                return bytes(kept)
            if len(kept) < self.max_output_bytes:
                kept.extend(chunk[: self.max_output_bytes - len(kept)])
