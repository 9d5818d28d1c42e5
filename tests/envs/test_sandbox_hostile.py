"""Hostile snippets against every sandbox path this machine offers (issue 26).

Each snippet goes through `ToolSet.run`, the path the agent loop uses, and each test asserts
both sides: the snippet's (a ToolResult with a counted error or a capped output, never an
exception out of the loop, and the tool still answers afterwards) and the host's (the memory the
host lost while the call ran, sampled from /proc/meminfo every few milliseconds, stays within
the call's budget; no process of the call is left; the trainer's files, /dev/shm and the cgroup
folders are as they were).

Paths: `bwrap+cgroup` (bubblewrap, one memory and pids cgroup per call), `bwrap+rlimit`
(bubblewrap, per-process limits: run as the unprivileged user `nobody` through
sandbox_runner.py when the tests run as root), `off+cgroup` and `off+rlimit` (no sandbox, on
purpose). Where a path does not hold something, the test says so by name (docs/sandbox.md lists
the same), and snippets that would harm the machine under it (filling the host's disk or
/dev/shm, killing the test process) are not run there.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_agent.envs.tools import ToolSet, cgroups, sandbox_metrics
from megatron_agent.envs.tools.python import Python, SandboxUnavailable, unsandboxed_prefix
from megatron_agent.envs.tools.sandbox import find_bwrap

ROOT = Path(__file__).resolve().parents[2]
BUDGET_MB, TMP_MB, MAX_PROCESSES, TIMEOUT_S = 384, 16, 8, 4.0
SLACK_MB = 96
"""What the host may lose beyond the budget per running call: what the kernel keeps for its
processes outside the cgroup's count and the tool's pipes (measured: about 45 MiB per call with
8 processes on a quiet machine, up to about 70 under the CI suite)."""
NOISE_MB = 192
"""How far /proc/meminfo moves on this kind of machine with nothing running (a VM's memory comes
and goes: up to 150 MiB measured within seconds). The cgroup's own peak is checked exactly."""
TOKEN = f"mah{secrets.token_hex(4)}"
"""In the command line or the name of every process a snippet tries to leave behind."""
LIMITS = dict(timeout_s=TIMEOUT_S, memory_mb=BUDGET_MB, tmp_mb=TMP_MB, max_processes=MAX_PROCESSES)


# ------------------------------------------------------------------------------- the callers
class InProcess:
    """The tool in this process."""

    def __init__(self, **kwargs):
        self.tool = Python(**LIMITS | kwargs)
        self.tools = ToolSet([self.tool], timeout_s=TIMEOUT_S)
        self.path, self.process_mb = self.tool.path, self.tool.process_memory_bytes >> 20

    def call(self, code: str) -> dict:
        result = asyncio.run(self.tools.run("python", {"code": code}))
        return {
            "status": result.status,
            "text": result.text,
            "seconds": result.seconds,
            "peak": self.tool.last_peak_bytes,
        }

    def gather(self, codes: list[str]) -> list[dict]:
        async def every():
            return await asyncio.gather(*(self.tools.run("python", {"code": c}) for c in codes))

        return [{"status": r.status, "text": r.text} for r in asyncio.run(every())]

    def close(self) -> None:
        pass


AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
RUNNER_ENV = {
    "PATH": os.environ["PATH"],
    "PYTHONPATH": str(ROOT),
    "PYTHONDONTWRITEBYTECODE": "1",
    "HOME": "/tmp",
}


def interpreter_for_nobody() -> str | None:
    """An interpreter with which the user nobody can run the tool and its sandbox: this one, or
    the system's (a pyenv interpreter under /root is out of nobody's reach). The tool's modules
    need the standard library only."""
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        probe = "from megatron_agent.envs.tools.python import Python; Python(memory_mb=384, use_cgroup=False)"
        check = [*AS_NOBODY, python, "-c", probe]
        try:
            if (
                subprocess.run(check, env=RUNNER_ENV, cwd="/", capture_output=True, timeout=60).returncode
                == 0
            ):
                return python
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


class Unprivileged:
    """The tool in sandbox_runner.py, started as the user nobody (uid 65534)."""

    def __init__(self, **kwargs):
        python = interpreter_for_nobody()
        if python is None:
            raise RuntimeError("no interpreter that the user nobody can run and import the tool with")
        argv = [
            *AS_NOBODY,
            python,
            str(Path(__file__).with_name("sandbox_runner.py")),
            json.dumps(LIMITS | kwargs),
        ]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=RUNNER_ENV, cwd="/"
        )
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"sandbox_runner.py did not start (exit status {self.proc.wait()})")
        info = json.loads(hello)
        self.path, self.process_mb = info["path"], info["process_mb"]

    def _ask(self, request: dict):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def call(self, code: str) -> dict:
        return self._ask({"code": code})

    def gather(self, codes: list[str]) -> list[dict]:
        return self._ask({"codes": codes})

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _bwrap_works() -> bool:
    try:
        Python(**LIMITS, sandbox="auto")
        return True
    except SandboxUnavailable:
        return False


def make_caller(path: str, **kwargs):
    """A caller on `path` (with these tool arguments), or pytest.skip naming why this machine
    does not offer it."""
    if path.startswith("bwrap") and (find_bwrap() is None or not _bwrap_works()):
        pytest.skip("bubblewrap is missing or cannot start its sandbox here")
    if path.endswith("+cgroup"):
        if cgroups.support() is None:
            pytest.skip("no writable memory and pids cgroups here")
        return InProcess(sandbox="auto" if path.startswith("bwrap") else "off", **kwargs)
    if path == "off+rlimit":
        return InProcess(sandbox="off", use_cgroup=False, **kwargs)
    if os.geteuid() != 0:
        return InProcess(sandbox="auto", use_cgroup=False, **kwargs)
    if shutil.which("setpriv") is None:
        pytest.skip("the rlimit path needs a non-root user: setpriv is missing")
    try:
        return Unprivileged(sandbox="auto", use_cgroup=False, **kwargs)
    except RuntimeError as exc:
        pytest.skip(f"bubblewrap does not run for an unprivileged user here: {exc}")


PATHS = ["bwrap+cgroup", "bwrap+rlimit", "off+cgroup", "off+rlimit"]


@pytest.fixture(scope="module", params=PATHS)
def caller(request):
    made = make_caller(request.param)
    assert made.path == request.param
    yield made
    made.close()


def sandboxed(caller) -> bool:
    return caller.path.startswith("bwrap")


def pid_namespace(caller) -> bool:
    return sandboxed(caller) or "--pid" in unsandboxed_prefix()


# ------------------------------------------------------------------------------- the host side
def host_used_mb() -> float:
    """Memory in use on the host, tmpfs pages included and page cache left out (it comes and goes
    with the files anyone reads): MemTotal - MemFree - Buffers - (Cached - Shmem) - SReclaimable."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0])
    cache = info["Cached"] - info["Shmem"]
    return (info["MemTotal"] - info["MemFree"] - info["Buffers"] - cache - info["SReclaimable"]) / 1024


class HostMemory:
    """The most memory the host lost while the block ran (`host_used_mb`, sampled every 5 ms), in MiB."""

    def __enter__(self):
        self.baseline = min(host_used_mb() for _ in range(5))
        self.highest, self.done = self.baseline, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.is_set():
            self.highest = max(self.highest, host_used_mb())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.lost_mb = self.highest - self.baseline


def leftovers() -> list[str]:
    """Processes whose command line or name holds TOKEN."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                seen = (entry / "cmdline").read_bytes() + (entry / "comm").read_bytes()
            except OSError:
                continue
            if TOKEN.encode() in seen:
                found.append(f"{entry.name}: {seen[:200]!r}")
    return found


def call_cgroups() -> list[str]:
    where = cgroups.support()
    if where is None:
        return []
    return sorted(str(p) for parent in set(where.parents.values()) for p in parent.glob("ma_python_*"))


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A trainer's run folder: metrics, a secret, a checkpoint."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "secret.txt").write_text("TRAINER-SECRET-1234\n")
    (run / "checkpoints" / "step_000010" / "model.bin").write_bytes(os.urandom(4096))
    return run


def host_shm() -> list[str]:
    """The host's /dev/shm, without the trainer's own segments (`megatron-agent-*`: a run elsewhere
    on the machine makes and removes them at its own pace; tests/train/test_driver_kill.py covers them)."""
    return sorted(name for name in os.listdir("/dev/shm") if not name.startswith("megatron-agent-"))


def snapshot(folder: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def hostile(caller, code: str, run_dir: Path) -> dict:
    """Run `code`; assert the host's side (module docstring) and that the tool still answers."""
    before = (snapshot(run_dir), host_shm(), call_cgroups())
    with HostMemory() as host:
        result = caller.call(code)
    time.sleep(0.05)  # what the kernel frees after a kill
    assert result["status"] in ("ok", "error", "timeout"), result
    assert host.lost_mb <= BUDGET_MB + SLACK_MB + NOISE_MB, (
        f"the host lost {host.lost_mb:.0f} MiB: {result['text'][-300:]}"
    )
    if result.get("peak") is not None:
        assert result["peak"] <= BUDGET_MB << 20
    assert leftovers() == []
    assert (snapshot(run_dir), host_shm(), call_cgroups()) == before
    assert caller.call("print(6 * 7)")["text"] == "42\n"
    return result


# ------------------------------------------------------------------------------- the snippets
@pytest.fixture
def home_secret():
    """A file in the home folder (which the sandbox shows only as the mount points of the
    interpreter, when it lives there)."""
    secret = Path.home() / f".{TOKEN}"
    secret.write_text("HOME-SECRET\n")
    yield secret
    secret.unlink()


def test_reading_host_files(caller, run_dir, home_secret):
    for path in ("/etc/passwd", str(ROOT / "README.md"), str(home_secret), str(run_dir / "secret.txt")):
        result = hostile(caller, f"print(open({path!r}).read()[:100])", run_dir)
        if sandboxed(caller):
            assert result["status"] == "error" and "FileNotFoundError" in result["text"], (path, result)
        else:  # off holds no file system: the snippet reads what the trainer's user can
            assert result["status"] == "ok", (path, result)
    listing = hostile(caller, f"import os\nprint(os.listdir({str(Path.home())!r}))", run_dir)["text"]
    assert (TOKEN in listing) != sandboxed(caller), listing


def test_reading_the_environment_of_other_processes(caller, run_dir):
    # A process of the trainer's user with a secret in its environment (as Ray's workers have).
    trainer = subprocess.Popen(
        ["sleep", "60"], env={"PATH": os.environ["PATH"], "MA_TRAINER_SECRET": "hunter2"}
    )
    code = (
        "import os\nfound = []\n"
        "for pid in ['1', str(os.getppid())] + os.listdir('/proc'):\n"
        "    try:\n        found.append(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except (OSError, ValueError):\n        pass\n"
        "print(b'hunter2' in b''.join(found), len(found))"
    )
    try:
        result = hostile(caller, code, run_dir)
    finally:
        trainer.kill()
        trainer.wait()
    if sandboxed(caller):
        assert result["text"].startswith("False"), result
    else:  # off: the host's /proc, as the trainer's user
        assert result["text"].startswith("True"), result


def test_killing_the_parent(caller, run_dir):
    if not pid_namespace(caller):
        pytest.skip(
            f"{caller.path} without a PID namespace: the snippet can kill the engine (docs/sandbox.md)"
        )
    result = hostile(
        caller, "import os, time\nos.kill(os.getppid(), 9)\ntime.sleep(0.5)\nprint('alive')", run_dir
    )
    # bubblewrap: the parent is the sandbox's init, which ignores it; off: getppid() is 0 in the
    # new PID namespace, so the snippet killed its own process group.
    assert result["status"] == ("ok" if sandboxed(caller) else "error"), result


def test_forking_200_times(caller, run_dir):
    code = (
        "import ctypes, os, time\nn = 0\n"
        "for _ in range(200):\n"
        "    if os.fork() == 0:\n"
        f"        ctypes.CDLL(None).prctl(15, {TOKEN.encode()!r}, 0, 0, 0)  # its name: TOKEN\n"
        "        time.sleep(60)\n        os._exit(0)\n"
        "    n += 1\n"
        "print('forked', n)"
    )
    result = hostile(caller, code, run_dir)
    if caller.path != "off+rlimit":
        assert result["status"] == "error" and "BlockingIOError" in result["text"], result
    else:  # nothing counts processes there; the PID namespace still kills them all (leftovers)
        assert result["text"].startswith("forked 200") or result["status"] == "timeout", result


def test_allocating_8_gb_in_one_process(caller, run_dir):
    result = hostile(caller, "x = bytearray(8 << 30)\nprint(len(x))", run_dir)
    assert result["status"] == "error" and "MemoryError" in result["text"], result


@pytest.mark.parametrize("child_mb", [450, "limit"])
def test_allocating_in_8_children(caller, run_dir, child_mb):
    if child_mb == "limit":  # each child just under its own address-space limit: the sum is the test
        if caller.path == "off+rlimit":
            pytest.skip("off+rlimit holds each process, not their sum (docs/sandbox.md)")
        child_mb = int(caller.process_mb * 0.8)
    code = (
        "import os, time\npids = []\n"
        "for _ in range(8):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        f"        b = bytearray({child_mb} << 20)\n"
        "        b[::4096] = b'x' * len(b[::4096])\n"
        "        time.sleep(1)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print([os.waitpid(p, 0)[1] for p in pids])"
    )
    result = hostile(caller, code, run_dir)
    assert result["status"] in ("ok", "error"), result
    if result["status"] == "ok" and child_mb * 8 > BUDGET_MB:
        assert result["text"] != "[0, 0, 0, 0, 0, 0, 0, 0]\n"  # not all of them got their memory


def test_writing_a_2_gb_file(caller, run_dir):
    result = hostile(
        caller, "f = open('big', 'wb')\nfor _ in range(2048):\n    f.write(b'x' * (1 << 20))", run_dir
    )
    # 16 MiB per file; under bubblewrap the 16 MiB working folder may be full first
    assert result["status"] == "error", result
    assert "File too large" in result["text"] or (sandboxed(caller) and "No space left" in result["text"]), (
        result
    )


@pytest.mark.parametrize("folder", [".", "/dev/shm"])
def test_filling_a_tmpfs(caller, run_dir, folder):
    if not sandboxed(caller):
        pytest.skip(f"off writes {folder} on the host: bounded by the file size and the timeout only")
    code = (
        "import os\nprint(os.listdir('/dev/shm'))\n"
        "for i in range(1000):\n"
        f"    with open(os.path.join({folder!r}, f'f{{i}}'), 'wb') as f:\n        f.write(b'x' * (8 << 20))"
    )
    result = hostile(caller, code, run_dir)
    assert "\n[]\n" in result["text"] and "No space left on device" in result["text"], result


@pytest.mark.parametrize("how", ["new session", "double fork"])
def test_leaving_a_background_process(caller, run_dir, how):
    if not pid_namespace(caller) and not caller.path.endswith("+cgroup"):
        pytest.skip("off without a cgroup or a PID namespace kills the session only")
    child = f"[sys.executable, '-c', 'import time; time.sleep(60)', {TOKEN!r}]"
    if how == "new session":
        code = f"import subprocess, sys\nsubprocess.Popen({child}, start_new_session=True, stdout=subprocess.DEVNULL)\nprint('left')"
    else:
        code = (
            "import os, sys\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, {child})\n    os._exit(0)\n"
            "os.wait()\nprint('left')"
        )
    result = hostile(caller, code, run_dir)  # asserts that nothing with TOKEN is left
    assert result["status"] == "ok" and result["seconds"] < TIMEOUT_S, result


def test_connecting_to_a_listener_on_localhost(caller, run_dir):
    if not sandboxed(caller) and "--net" not in unsandboxed_prefix():
        pytest.skip("off without a network namespace reaches the host's network")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
        result = hostile(caller, code, run_dir)
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody ever connected
    assert result["status"] == "error", result  # refused (bubblewrap's loopback) or unreachable (none)
    assert "ConnectionRefusedError" in result["text"] or "Network is unreachable" in result["text"], result


def test_looping_forever(caller, run_dir):
    result = hostile(caller, "while True:\n    pass", run_dir)
    assert result["status"] == "timeout" and result["seconds"] < TIMEOUT_S + 2, result


def test_printing_50_mb(caller, run_dir):
    result = hostile(
        caller, "import sys\nfor _ in range(50):\n    sys.stdout.write('x' * (1 << 20))", run_dir
    )
    assert result["status"] == "ok" and result["text"] == "x" * (64 * 1024), result["text"][:100]


def test_segfaulting(caller, run_dir):
    result = hostile(caller, "import ctypes\nctypes.string_at(0)", run_dir)
    assert result["status"] == "error" and "killed by SIGSEGV" in result["text"], result


# ------------------------------------------------------------------------------- concurrency
@pytest.mark.parametrize("path", ["bwrap+cgroup", "bwrap+rlimit"])
def test_16_concurrent_hostile_calls_stay_within_the_cap(path, run_dir):
    cap = 3
    caller = make_caller(path, max_concurrent=cap)
    # Every call takes all it can: 8 children just under their limit, plus its tmpfs and /dev/shm.
    code = (
        "import os, time\n"
        "for folder in ('.', '/dev/shm'):\n"
        "    try:\n        open(os.path.join(folder, 'fill'), 'wb').write(b'x' * (16 << 20))\n"
        "    except OSError:\n        pass\n"
        "for _ in range(7):\n"
        "    if os.fork() == 0:\n"
        "        try:\n"
        f"            b = bytearray({int(caller.process_mb * 0.8)} << 20)\n"
        "            b[::4096] = b'x' * len(b[::4096])\n"
        "        except MemoryError:\n            pass\n"
        "        time.sleep(1.5)\n        os._exit(0)\n"
        "time.sleep(1.5)\nprint('done')"
    )
    bound, lost = cap * (BUDGET_MB + SLACK_MB) + NOISE_MB, []
    try:
        # The host's memory also moves by itself (a VM's memory, processes of earlier tests ending):
        # a figure above the bound is measured once more (1212-1325 MiB alone, once 1661 under the
        # CI suite). A sandbox that let more than `cap` calls run at once exceeds it every time.
        while len(lost) < 2 and (not lost or lost[-1] > bound):
            with HostMemory() as host:
                results = caller.gather([code] * 16)
            assert all(r["status"] in ("ok", "error") for r in results), results
            lost.append(host.lost_mb)
    finally:
        caller.close()
    assert lost[-1] <= bound, f"the host lost {', then '.join(f'{x:.0f}' for x in lost)} MiB (bound {bound})"
    assert leftovers() == [] and call_cgroups() == []


def test_sandbox_metrics_name_the_path_and_count_memory_kills():
    if cgroups.support() is None or find_bwrap() is None:
        pytest.skip("needs bubblewrap and cgroups")
    caller = InProcess(sandbox="auto")
    code = (  # two children of 250 MiB each: one is killed at the 384 MiB budget
        "import os, time\n"
        "for _ in range(2):\n"
        "    if os.fork() == 0:\n"
        "        c = bytearray(250 << 20)\n        c[::4096] = b'x' * len(c[::4096])\n"
        "        time.sleep(1)\n        os._exit(0)\n"
        "print(sorted(os.wait()[1] for _ in range(2)))"
    )
    assert caller.call(code)["text"] == "[0, 9]\n"
    metrics = sandbox_metrics(caller.tools)
    assert metrics["tool/sandbox_path"] == 2.0 and metrics["tool/sandboxed"] == 1.0
    assert metrics["tool/python_oom_kills"] == 1.0 and 250 <= metrics["tool/python_peak_mb"] <= BUDGET_MB
    assert sandbox_metrics(caller.tools)["tool/python_oom_kills"] == 0.0  # since the last read


# ------------------------------------------------------------------------------- beyond rlimits
MEMFD = (  # 60 anonymous memory files of 15 MiB: no address-space limit sees them
    "import os, time\nfds = []\n"
    "for _ in range(60):\n    fd = os.memfd_create('x')\n    os.write(fd, b'x' * (15 << 20))\n    fds.append(fd)\n"
    "print(len(fds))\ntime.sleep(1)"
)
SYSV = (  # System V segments of 30 MiB, filled and detached: they outlive every mapping
    "import ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
    "for n in range(100):\n"
    "    shm = libc.shmget(0, 30 << 20, 0o1600)\n"
    "    if shm < 0:\n        raise OSError(ctypes.get_errno(), 'shmget')\n"
    "    a = libc.shmat(shm, None, 0)\n    ctypes.memset(a, 1, 30 << 20)\n    libc.shmdt(ctypes.c_void_p(a))\n"
    "print(n)\ntime.sleep(1)"
)


@pytest.mark.parametrize("code", [MEMFD, SYSV], ids=["memfd", "sysv-shm"])
def test_memory_that_outlives_its_mappings(caller, run_dir, code):
    if caller.path == "off+rlimit":
        pytest.skip("off+rlimit bounds neither memory files nor System V segments (docs/sandbox.md)")
    result = hostile(caller, code, run_dir)  # the host lost at most the budget
    if sandboxed(caller):  # refused by the sandbox's seccomp filter
        assert result["status"] == "error" and (
            "PermissionError" in result["text"] or "[Errno 1]" in result["text"]
        ), result
