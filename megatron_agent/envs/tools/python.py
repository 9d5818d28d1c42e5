"""`python`: run a snippet in a bubblewrap sandbox with time, memory, process and output limits.

`sandbox` chooses the isolation:
- `strict`: every snippet runs under bubblewrap (see `sandbox.py`): user `nobody` in new user,
  PID, mount, network, IPC and UTS namespaces, a read-only view of the interpreter and its
  standard library only, a private size-limited tmpfs as working folder, no network, at most
  `max_processes` processes and threads. The tool refuses to start when bwrap is missing or
  cannot create its namespaces here (the error says how to fix it).
- `auto` (default): as `strict` when bwrap works here; otherwise the snippet runs as a plain
  `python -I` subprocess of the trainer's user with the resource limits only (address space, CPU
  time, file size; an empty network namespace where `unshare -n` works). That fallback is NOT a
  sandbox: the snippet can read and write every file the trainer can. It is announced by a loud
  warning, counted in `num_unsandboxed_calls` (reported as `tool/unsandboxed`) and `sandboxed`
  is False.
- `off`: the fallback on purpose, for a person who has decided so (counted the same way).
In every mode: a wall-clock timeout kills the whole process tree, output is capped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile

from megatron_agent.envs.tools import sandbox as bw
from megatron_agent.envs.tools.base import Tool

logger = logging.getLogger(__name__)

SANDBOX_MODES = ("auto", "strict", "off")
FILE_SIZE_LIMIT = 16 << 20
"""Largest file a snippet may write (RLIMIT_FSIZE), in bytes."""


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare -n` can create a network namespace here."""
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def _probe(bwrap: str) -> str | None:
    return bw.probe(bwrap)


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
    description = (
        "Run a Python 3 snippet (standard library only) and return its printed output. "
        "No network, no files kept, no state between calls."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source; print the result"}},
        "required": ["code"],
    }

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_output_bytes: int = 64 * 1024,
        *,
        sandbox: str = "auto",
        max_processes: int = 16,
        tmp_mb: int = 64,
        bwrap: str | None = None,
    ):
        """Limits: wall and CPU time `timeout_s`, address space `memory_mb`, captured output,
        processes and threads `max_processes`, private tmpfs `tmp_mb`. `sandbox`: strict, auto
        or off (module docstring); `bwrap`: the bubblewrap executable (default: found on PATH)."""
        if sandbox not in SANDBOX_MODES:
            raise ValueError(f"tools.python.sandbox={sandbox!r}: use one of {', '.join(SANDBOX_MODES)}")
        if max_processes < 1 or memory_mb < 16:
            raise ValueError(
                f"python tool limits too small: max_processes={max_processes} (>= 1), memory_mb={memory_mb} (>= 16)"
            )
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.max_processes = max_processes
        self.tmp_mb = tmp_mb
        self.mode = sandbox
        self.num_calls = 0
        self.num_unsandboxed_calls = 0
        self.bwrap = self._choose_bwrap(sandbox, bwrap)
        self.sandboxed = self.bwrap is not None
        self.process_limit = bw.process_limit_mechanism() if self.sandboxed else None
        """How max_processes is enforced: 'rlimit', 'cgroup', or None (not enforced)."""
        if self.sandboxed and self.process_limit is None:
            msg = (
                "python tool: running as root without a writable pids cgroup, so max_processes "
                "cannot be enforced (the kernel exempts root from RLIMIT_NPROC); run the trainer "
                "as a non-root user, or give it a writable pids cgroup"
            )
            if sandbox == "strict":
                raise RuntimeError(msg + ", or set tools.python.sandbox=auto to accept this")
            logger.warning(msg)
        self.network_isolated = self.sandboxed or network_namespace_available()
        if not self.sandboxed and not self.network_isolated:
            logger.warning(
                "python tool: `unshare -n` is not available here; snippets are NOT cut off from the network"
            )

    @staticmethod
    def _choose_bwrap(mode: str, path: str | None) -> str | None:
        """The working bwrap for `mode`, None for the unsandboxed fallback; raises under strict."""
        if mode == "off":
            logger.warning(
                "python tool: tools.python.sandbox=off: snippets run WITHOUT a sandbox, as this user "
                "(they can read and write the run folder and its checkpoints)"
            )
            return None
        bwrap = bw.find_bwrap(path)
        if bwrap is None:
            problem = f"bubblewrap not found ({path or 'bwrap on PATH'})"
        else:
            error = _probe(bwrap)
            if error is None:
                return bwrap
            problem = f"bubblewrap ({bwrap}) cannot start its sandbox here: {error}"
        if mode == "strict":
            fix = (
                bw.INSTALL_HINT
                if bwrap is None
                else "allow user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 "
                "also kernel.apparmor_restrict_unprivileged_userns=0; in a container, a seccomp "
                "profile that permits them), or set tools.python.sandbox=auto to run with resource limits only"
            )
            raise RuntimeError(f"tools.python.sandbox=strict: {problem}. To fix: {fix}")
        logger.warning(
            "!!! python tool: %s. Snippets run WITHOUT a sandbox: as this user, with resource limits "
            "only; they can read, change and delete every file this user can, the run folder and "
            "its checkpoints included. Counted as tool/unsandboxed. To fix: %s; "
            "tools.python.sandbox=strict refuses to run without it.",
            problem,
            bw.INSTALL_HINT,
        )
        return None

    async def call(self, code: str) -> bytes:
        """Run `code`; raises on a non-zero exit with the output in the message."""
        self.num_calls += 1
        if self.sandboxed:
            returncode, output = await self._run_sandboxed(code)
        else:
            self.num_unsandboxed_calls += 1
            returncode, output = await self._run_unsandboxed(code)
        if returncode != 0:
            tail = output[-2000:].decode("utf-8", errors="replace")
            raise RuntimeError(f"exit status {returncode}\n{tail}")
        return output

    async def _run_sandboxed(self, code: str) -> tuple[int, bytes]:
        workdir = f"/tmp/ma_python_{secrets.token_hex(6)}"
        cgroup = None
        if self.process_limit == "cgroup":
            cgroup = bw.PidsCgroup(self.max_processes + 2)  # + bwrap's monitor and init
        code_fd = os.memfd_create("snippet")
        try:
            os.write(code_fd, code.encode("utf-8", errors="surrogatepass"))
            os.lseek(code_fd, 0, os.SEEK_SET)
            argv = bw.bwrap_argv(
                self.bwrap,
                workdir=workdir,
                code_fd=code_fd,
                memory_bytes=self.memory_mb << 20,
                cpu_s=max(1, int(self.timeout_s) + 1),
                file_bytes=FILE_SIZE_LIMIT,
                max_processes=self.max_processes,
                tmp_bytes=self.tmp_mb << 20,
            )
            return await self._spawn(
                argv, env=bw.minimal_env(workdir), pass_fds=(code_fd,), preexec_fn=cgroup and cgroup.enter
            )
        finally:
            os.close(code_fd)
            if cgroup is not None:
                cgroup.close()

    async def _run_unsandboxed(self, code: str) -> tuple[int, bytes]:
        with tempfile.TemporaryDirectory(prefix="ma_python_") as workdir:
            script = os.path.join(workdir, "main.py")
            with open(script, "w") as f:
                f.write(code)
            argv = [sys.executable, "-I", "-B", script]
            if self.network_isolated:
                argv = ["unshare", "-n"] + argv
            limits = _limits(self.memory_mb << 20, max(1, int(self.timeout_s) + 1), FILE_SIZE_LIMIT)
            return await self._spawn(argv, env=bw.minimal_env(workdir), cwd=workdir, preexec_fn=limits)

    async def _spawn(self, argv: list[str], *, env: dict, **kwargs) -> tuple[int, bytes]:
        """Run `argv` in its own session; kill its process group when done or cancelled."""
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            **kwargs,
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
        return proc.returncode, output

    async def _read_capped(self, proc) -> bytes:
        """Read all output, keeping the first `max_output_bytes` (the rest is drained and dropped)."""
        kept = bytearray()
        while True:
            chunk = await proc.stdout.read(65536)
            if not chunk:
                return bytes(kept)
            if len(kept) < self.max_output_bytes:
                kept.extend(chunk[: self.max_output_bytes - len(kept)])
