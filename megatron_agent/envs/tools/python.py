"""`python`: run a snippet in a bubblewrap sandbox that holds files, network, processes, time,
output and memory, with a cap on concurrent calls.

`sandbox` chooses the isolation:
- `auto` (default) and `strict` (the same since the sandbox fails closed): every snippet runs
  under bubblewrap (see `sandbox.py`). When bwrap is missing, cannot create its namespaces, or
  cannot hold the call's processes and memory here, the tool refuses to start with an error
  naming what is missing and the two ways out.
- `off`: no sandbox, on purpose: a `python -I` subprocess of the trainer's user with the limits
  below (a loud warning at start, every call counted as `tool/unsandboxed`).

The memory budget `memory_mb` holds for the whole call, whatever the snippet does:
- **cgroup path** (`bwrap+cgroup`, `off+cgroup`): one memory and pids cgroup per call (cgroups.py)
  holds every process and every page of its tmpfs at `memory_mb`; the call's processes are all
  killed when it ends. Used wherever this process can create cgroups.
- **rlimit path** (`bwrap+rlimit`): each process gets an equal share of the budget as address
  space, `(memory_mb - tmp_mb - shm) / max_processes`, and both tmpfs are sized, so that the sum
  over `max_processes` processes stays within it. As root the process count needs a cgroup, so
  root without one is refused.
`off` without a cgroup holds only per-process limits (docs/sandbox.md says exactly what).

At most `max_concurrent` calls run at once (the rest wait for a slot; `timeout_s` counts from
when a call starts running), so the worst case is `memory_mb x max_concurrent`; the tool checks
at start that this fits in half of the machine's available memory.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from megatron_agent.envs.tools import cgroups, seccomp
from megatron_agent.envs.tools import sandbox as bw
from megatron_agent.envs.tools.base import Tool
from megatron_agent.errors import InputError
from megatron_agent.platform.free_memory import available_memory_bytes

logger = logging.getLogger(__name__)

SANDBOX_MODES = ("auto", "strict", "off")
FILE_SIZE_LIMIT = 16 << 20
"""Largest file a snippet may write (RLIMIT_FSIZE), in bytes."""
SHM_MB = 16
"""Size of the sandbox's /dev/shm, counted in the call's budget."""
MIN_PROCESS_MB = 32
"""Smallest address space the rlimit path gives one process (the interpreter needs about 16)."""
PATH_CODES = {"bwrap+cgroup": 2.0, "bwrap+rlimit": 1.0, "off+cgroup": 0.0, "off+rlimit": 0.0}
"""`tool/sandbox_path`: 2 bubblewrap with a per-call cgroup, 1 bubblewrap with per-process
limits, 0 no sandbox."""
OUTPUT_GRACE_S = 1.0
"""How long output is still read after the snippet's process ended (a child may hold the pipe)."""
WAYS_OUT = (
    "either {fix}, or set tools.python.sandbox=off to run snippets without a sandbox, on "
    "purpose (only for code you trust: docs/sandbox.md says what off holds)"
)


class SandboxUnavailable(InputError):
    """The sandbox cannot hold a call here: the tool refuses to start (fails closed)."""


@functools.cache
def _probe(bwrap: str) -> str | None:
    return bw.probe(bwrap)


@functools.cache
def unsandboxed_prefix() -> tuple[str, ...]:
    """The `unshare` prefix an `off` call runs under: new PID, network and IPC namespaces where
    they can be made (the call's processes, and its System V segments, then all go with it), else
    a network namespace only, else nothing."""
    for prefix in (
        ("unshare", "--pid", "--fork", "--kill-child", "--net", "--ipc"),
        ("unshare", "--map-root-user", "--pid", "--fork", "--kill-child", "--net", "--ipc"),
        ("unshare", "--net"),
    ):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return ()


def default_max_concurrent(memory_mb: int, copies: int = 1) -> int:
    """`tools.max_concurrent=0`: the cores shared between `copies` tools, fewer when their calls
    of `memory_mb` each would take more than half the available memory (at least 1)."""
    by_memory = available_memory_bytes() // 2 // (copies * (memory_mb << 20))
    return max(1, min((os.cpu_count() or 1) // copies, by_memory))


def check_worst_case(memory_mb: int, max_concurrent: int, copies: int = 1) -> None:
    """Raise an InputError when `copies` tools running `max_concurrent` calls of `memory_mb`
    each could take more than half of this machine's available memory."""
    worst, available = copies * max_concurrent * (memory_mb << 20), available_memory_bytes()
    if worst > available // 2:
        engines = f" x {copies} engines on this machine" if copies > 1 else ""
        raise InputError(
            f"tools.max_concurrent={max_concurrent} x tools.python.memory_mb={memory_mb}{engines} = "
            f"{worst / 2**30:.1f} GiB of snippets at worst, more than half of this machine's "
            f"available memory ({available / 2**30:.1f} GiB): lower tools.max_concurrent or "
            "tools.python.memory_mb"
        )


def remove_orphaned_workdirs(root: str | None = None) -> list[str]:
    """Remove the unsandboxed calls' working folders (`ma_python_<owner>_*` in `root`, by default
    the temporary folder) whose owner has ended (`cgroups.left_by_dead_owner`); return their names.
    A process killed while a call ran never removed the folder, with what the snippet wrote in it
    (up to `tmp_mb`)."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = os.listdir(root)
    except OSError:
        return removed
    for name in entries:
        path = os.path.join(root, name)
        if cgroups.left_by_dead_owner(name) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return sorted(removed)


@functools.cache
def _sweep_workdirs_once(root: str) -> None:
    remove_orphaned_workdirs(root)  # once per process and folder, like `cgroups.sweep_once`


def _limits(memory_bytes: int, cpu_s: int, file_bytes: int, enter=None):
    def apply() -> None:
        import resource

        if enter is not None:
            enter()
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
    limits_own_time = True

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_output_bytes: int = 64 * 1024,
        *,
        sandbox: str = "auto",
        max_processes: int = 8,
        tmp_mb: int = 64,
        max_concurrent: int = 0,
        copies: int = 1,
        bwrap: str | None = None,
        use_cgroup: bool = True,
    ):
        """Limits per call: wall and CPU time `timeout_s`, memory `memory_mb` (everything the
        call holds), captured output, processes and threads `max_processes`, working folder
        `tmp_mb` (a tmpfs, inside the budget). `max_concurrent` calls at once (0: one per core,
        within half the free memory); `copies`: the tools like this one on this machine (one per
        rollout engine), which share that half. `sandbox`: auto, strict or off (module docstring); `bwrap`:
        the bubblewrap executable (default: found on PATH); `use_cgroup=False` takes the rlimit
        path even where cgroups can be made."""
        if sandbox not in SANDBOX_MODES:
            raise ValueError(f"tools.python.sandbox={sandbox!r}: use one of {', '.join(SANDBOX_MODES)}")
        if max_processes < 1 or memory_mb < 16 or max_concurrent < 0:
            raise ValueError(
                f"python tool limits too small: max_processes={max_processes} (>= 1), "
                f"memory_mb={memory_mb} (>= 16), max_concurrent={max_concurrent} (>= 0)"
            )
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.max_processes = max_processes
        self.tmp_mb = tmp_mb
        self.mode = sandbox
        self.cgroups = cgroups.support() if use_cgroup else None
        """Where the per-call cgroups are made; None: the rlimit path."""
        if self.cgroups is not None:
            cgroups.sweep_once(self.cgroups)  # what a killed process's calls left
        self.bwrap = self._choose_bwrap(sandbox, bwrap)
        self.sandboxed = self.bwrap is not None
        self.path = ("bwrap" if self.sandboxed else "off") + ("+cgroup" if self.cgroups else "+rlimit")
        """Which limits hold a call: bwrap+cgroup, bwrap+rlimit, off+cgroup or off+rlimit."""
        self.process_memory_bytes = self._process_memory_bytes()
        """RLIMIT_AS of each process of a call."""
        self.prefix = () if self.sandboxed else unsandboxed_prefix()
        if not self.sandboxed:
            _sweep_workdirs_once(tempfile.gettempdir())
        self.network_isolated = self.sandboxed or "--net" in self.prefix
        self.max_concurrent = max_concurrent or default_max_concurrent(memory_mb, copies)
        check_worst_case(memory_mb, self.max_concurrent, copies)
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self.num_calls = 0
        self.num_unsandboxed_calls = 0
        self.num_oom_kills = 0
        """Calls with a process killed at the memory budget (cgroup path)."""
        self.last_peak_bytes: int | None = None
        """The most memory the latest call held at once (cgroup path)."""
        self.max_peak_bytes = 0
        self.max_wait_s = 0.0
        """Largest peak and largest wait for a slot since `sandbox_metrics` last read them."""
        logger.info(
            "python tool: %s, %d MiB per call, %d concurrent calls, %d processes",
            self.path,
            memory_mb,
            self.max_concurrent,
            max_processes,
        )
        if not self.sandboxed and not self.network_isolated:
            logger.warning(
                "python tool: `unshare --net` fails here; snippets are NOT cut off from the network"
            )

    def _choose_bwrap(self, mode: str, path: str | None) -> str | None:
        """The working bwrap, or None under `off`; raises SandboxUnavailable when the sandbox
        cannot hold a call here."""
        if mode == "off":
            logger.warning(
                "!!! python tool: tools.python.sandbox=off: snippets run WITHOUT a sandbox, as this "
                "user (they can read and write the run folder and its checkpoints). Counted as "
                "tool/unsandboxed."
            )
            return None
        bwrap = bw.find_bwrap(path)
        if bwrap is None:
            problem, fix = f"bubblewrap not found ({path or 'bwrap on PATH'})", bw.INSTALL_HINT
        elif (error := _probe(bwrap)) is not None:
            problem = f"bubblewrap ({bwrap}) cannot start its sandbox here: {error}"
            fix = (
                "allow user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 "
                "also kernel.apparmor_restrict_unprivileged_userns=0; in a container, a seccomp "
                "profile that permits them)"
            )
        elif self.cgroups is None and os.geteuid() == 0:
            problem = (
                "running as root without writable memory and pids cgroups, so a call's processes "
                "cannot be counted (the kernel exempts root from RLIMIT_NPROC)"
            )
            fix = "run the trainer as a non-root user, or give it writable memory and pids cgroups"
        elif self.cgroups is None and not seccomp.supported():
            problem = f"no cgroup can be made and this machine's architecture ({os.uname().machine}) has no seccomp filter here (seccomp.py)"
            fix = "give the trainer writable memory and pids cgroups"
        elif self.cgroups is None and not bw.supports_tmpfs_size(bwrap):
            problem = f"this bubblewrap ({bwrap}) cannot size a tmpfs (--size needs bubblewrap >= 0.5) and no cgroup can be made"
            fix = "install bubblewrap >= 0.5, or give the trainer writable memory and pids cgroups"
        else:
            return bwrap
        raise SandboxUnavailable(
            f"tools.python.sandbox={mode}: {problem}. The python tool does not run snippets "
            f"unsandboxed unless told to: {WAYS_OUT.format(fix=fix)}"
        )

    def _process_memory_bytes(self) -> int:
        """Address space per process: the whole budget under a cgroup (which holds the sum), an
        equal share of what the tmpfs leave on the rlimit path."""
        if self.cgroups is not None or not self.sandboxed:
            return self.memory_mb << 20
        share_mb = (self.memory_mb - self.tmp_mb - SHM_MB) // self.max_processes
        if share_mb < MIN_PROCESS_MB:
            raise InputError(
                f"tools.python.memory_mb={self.memory_mb} leaves {share_mb} MiB per process for "
                f"tools.python.max_processes={self.max_processes} (after the {self.tmp_mb} MiB "
                f"working folder and {SHM_MB} MiB /dev/shm), under the {MIN_PROCESS_MB} MiB an "
                "interpreter needs: no cgroup can be made here, so the budget is split between "
                "processes; raise memory_mb or lower max_processes"
            )
        return share_mb << 20

    def _slot(self) -> asyncio.Semaphore:
        """This event loop's semaphore of `max_concurrent` slots."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.max_concurrent))
        return self._slots[1]

    async def call(self, code: str) -> bytes:
        """Run `code` once a slot is free, for at most `timeout_s` (TimeoutError); raises on a
        non-zero exit with the output in the message."""
        self.num_calls += 1
        if not self.sandboxed:
            self.num_unsandboxed_calls += 1
        queued = time.monotonic()
        async with self._slot():
            self.max_wait_s = max(self.max_wait_s, time.monotonic() - queued)
            async with asyncio.timeout(self.timeout_s):
                returncode, output, oom = await self._run(code)
        if returncode != 0:
            tail = output[-2000:].decode("utf-8", errors="replace")
            if oom:
                tail += "\n(a process of the snippet was killed: it went over its memory budget)"
            raise RuntimeError(f"{self._describe_exit(returncode)}\n{tail}")
        return output

    def _describe_exit(self, returncode: int) -> str:
        """'exit status N', or 'killed by SIGNAME' (bwrap reports a signal as 128 + its number)."""
        number = (
            -returncode if returncode < 0 else returncode - 128 if self.sandboxed and returncode > 128 else 0
        )
        try:
            return f"killed by {signal.Signals(number).name}" if number else f"exit status {returncode}"
        except ValueError:
            return f"exit status {returncode}"

    async def _run(self, code: str) -> tuple[int, bytes, bool]:
        """One call, inside its cgroup when there is one: exit status, output, and whether a
        process of it was killed at the memory budget."""
        if self.cgroups is None:
            run = self._run_sandboxed if self.sandboxed else self._run_unsandboxed
            return (*await run(code, None), False)
        # + bwrap's own two processes (its monitor and the sandbox's init)
        cgroup = cgroups.CallCgroup(self.memory_mb << 20, self.max_processes + 2, self.cgroups)
        oom = False
        try:
            run = self._run_sandboxed if self.sandboxed else self._run_unsandboxed
            returncode, output = await run(code, cgroup)
        finally:
            self.last_peak_bytes = cgroup.peak_bytes()
            self.max_peak_bytes = max(self.max_peak_bytes, self.last_peak_bytes or 0)
            oom = cgroup.oom_kills() > 0
            self.num_oom_kills += oom
            await asyncio.to_thread(cgroup.close)
        return returncode, output, oom

    async def _run_sandboxed(self, code: str, cgroup) -> tuple[int, bytes]:
        workdir = f"/tmp/ma_python_{secrets.token_hex(6)}"
        code_fd = os.memfd_create("snippet")
        rules = seccomp.filter_fd() if seccomp.supported() else None
        try:
            os.write(code_fd, code.encode("utf-8", errors="surrogatepass"))
            os.lseek(code_fd, 0, os.SEEK_SET)
            argv = bw.bwrap_argv(
                self.bwrap,
                workdir=workdir,
                code_fd=code_fd,
                memory_bytes=self.process_memory_bytes,
                cpu_s=max(1, int(self.timeout_s) + 1),
                file_bytes=FILE_SIZE_LIMIT,
                max_processes=self.max_processes,
                tmp_bytes=self.tmp_mb << 20,
                shm_bytes=SHM_MB << 20,
                seccomp_fd=rules,
            )
            fds = (code_fd,) if rules is None else (code_fd, rules)
            return await self._spawn(
                argv, env=bw.minimal_env(workdir), pass_fds=fds, preexec_fn=cgroup and cgroup.enter
            )
        finally:
            os.close(code_fd)
            if rules is not None:
                os.close(rules)

    async def _run_unsandboxed(self, code: str, cgroup) -> tuple[int, bytes]:
        with tempfile.TemporaryDirectory(prefix=f"ma_python_{cgroups.owner_tag()}_") as workdir:
            script = os.path.join(workdir, "main.py")
            with open(script, "w") as f:
                f.write(code)
            argv = [*self.prefix, sys.executable, "-I", "-B", script]
            cpu_s = max(1, int(self.timeout_s) + 1)
            limits = _limits(self.process_memory_bytes, cpu_s, FILE_SIZE_LIMIT, cgroup and cgroup.enter)
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
        kept = bytearray()
        reader = asyncio.create_task(self._read_capped(proc, kept))
        try:
            await proc.wait()
            # A process the snippet left behind may hold the pipe open: read what is there, then stop.
            await asyncio.wait([reader], timeout=OUTPUT_GRACE_S)
        finally:
            reader.cancel()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc.returncode is None:
                await proc.wait()
        return proc.returncode, bytes(kept)

    async def _read_capped(self, proc, kept: bytearray) -> None:
        """Read all output into `kept`, keeping the first `max_output_bytes` (the rest is
        drained and dropped)."""
        while chunk := await proc.stdout.read(65536):
            if len(kept) < self.max_output_bytes:
                kept.extend(chunk[: self.max_output_bytes - len(kept)])
