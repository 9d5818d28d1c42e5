"""The python tool's bubblewrap sandbox against hostile snippets (issue 11, point 7).

Each hostile snippet must fail inside the snippet (an error result naming the exception), and
the trainer's files (a run folder with metrics and a checkpoint) must stay byte-for-byte and
timestamp-for-timestamp unchanged. The refusal to start without bubblewrap (`auto` and `strict`
fail closed) and `off` are tested with a bwrap path that does not exist, so they run on any
machine. test_sandbox_hostile.py holds the memory, process and concurrency side.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sysconfig
from pathlib import Path

import pytest

from megatron_agent.envs.tools import ToolSet, cgroups, make_tool, sandbox_metrics
from megatron_agent.envs.tools.python import Python, SandboxUnavailable
from megatron_agent.envs.tools.sandbox import find_bwrap

ROOT = Path(__file__).resolve().parents[2]
MAX_PROCESSES = 8
needs_bwrap = pytest.mark.skipif(
    find_bwrap() is None, reason="bubblewrap is not installed (apt-get install -y bubblewrap)"
)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def strict_tools() -> ToolSet:
    if find_bwrap() is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    tool = Python(timeout_s=10.0, memory_mb=256, sandbox="strict", max_processes=MAX_PROCESSES, tmp_mb=8)
    assert tool.sandboxed
    return ToolSet([tool], timeout_s=20.0)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A trainer's run folder: metrics, a secret, a checkpoint."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000010"
    ckpt.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "actor/pg_loss": 0.5}\n')
    (run / "secret.txt").write_text("TRAINER-SECRET-1234\n")
    (ckpt / "model.bin").write_bytes(os.urandom(4096))
    (ckpt / "manifest.json").write_text('{"files": ["model.bin"]}')
    return run


def snapshot(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Every file and folder under `folder`: content hash, size, modification time."""
    out = {}
    for path in sorted(folder.rglob("*")):
        st = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        out[str(path.relative_to(folder))] = (digest, st.st_size, st.st_mtime_ns)
    return out


def hostile(tools: ToolSet, code: str, run_dir: Path) -> str:
    """Run `code`; assert it failed inside the snippet (a traceback, exit status 1) and left the
    run folder as it was; returns the snippet's output."""
    before = snapshot(run_dir)
    with pytest.raises(RuntimeError, match="exit status 1") as failure:
        run(tools.tools["python"].call(code=code))
    assert "Traceback" in str(failure.value)
    assert snapshot(run_dir) == before
    return str(failure.value)


def test_snippets_run_as_nobody_with_stdlib_only_and_no_trainer_environment(strict_tools, monkeypatch):
    monkeypatch.setenv("MA_TRAINER_TOKEN", "hunter2")
    code = (
        "import os, sys, json\n"
        "print(json.dumps([os.getuid(), os.getgid(), os.getcwd(), sorted(os.environ), sorted(os.listdir('/')),"
        " sum(p.isdigit() for p in os.listdir('/proc')) <= 3]))"
    )
    result = run(strict_tools.run("python", {"code": code}))
    assert result.status == "ok", result.text
    uid, gid, cwd, env, top, few_procs = __import__("json").loads(result.text)
    assert (uid, gid) == (65534, 65534)
    assert cwd.startswith("/tmp/ma_python_") and not os.path.exists(cwd)
    assert set(env) <= {"HOME", "LANG", "PATH", "PWD", "PYTHONIOENCODING"}
    assert "work" not in top and "home" not in top and few_procs  # own PID namespace
    # Installed packages (numpy comes with the trainer's venv) are out of sight.
    text = run(strict_tools.run("python", {"code": "import numpy"})).text
    assert "ModuleNotFoundError" in text


def test_reading_a_run_folder_file_fails(strict_tools, run_dir):
    result = run(strict_tools.run("python", {"code": f"open({str(run_dir / 'secret.txt')!r})"}))
    assert result.status == "error"  # what the agent loop sees: a masked error response
    text = hostile(strict_tools, f"print(open({str(run_dir / 'secret.txt')!r}).read())", run_dir)
    assert "FileNotFoundError" in text and "TRAINER-SECRET" not in text
    text = hostile(
        strict_tools, f"print(open({str(ROOT / 'megatron_agent' / 'config.py')!r}).read())", run_dir
    )
    assert "FileNotFoundError" in text


@pytest.mark.parametrize(
    "target,error",
    [
        ("RUN/evil.txt", "FileNotFoundError"),
        ("/evil.txt", "Read-only file system"),
        ("STDLIB/evil.py", "Read-only file system"),
        ("/proc/1/root/evil.txt", "Read-only file system"),
    ],
)
def test_writing_outside_the_temporary_folder_fails(strict_tools, run_dir, target, error):
    stdlib = sysconfig.get_paths()["stdlib"]
    path = target.replace("RUN", str(run_dir)).replace("STDLIB", stdlib)
    text = hostile(strict_tools, f"open({path!r}, 'w').write('pwned')", run_dir)
    assert error in text
    assert not os.path.exists(path)


def test_deleting_a_checkpoint_fails(strict_tools, run_dir):
    ckpt = run_dir / "checkpoints" / "step_000010"
    text = hostile(strict_tools, f"import shutil\nshutil.rmtree({str(ckpt)!r})", run_dir)
    assert "FileNotFoundError" in text
    text = hostile(strict_tools, f"import os\nos.remove({str(ckpt / 'model.bin')!r})", run_dir)
    assert "FileNotFoundError" in text
    assert (ckpt / "model.bin").stat().st_size == 4096


@pytest.mark.skipif(
    os.geteuid() == 0 and cgroups.support() is None, reason="root without writable memory and pids cgroups"
)
def test_forking_past_the_process_limit_fails(strict_tools, run_dir):
    code = (
        "import os, time\n"
        "children = []\n"
        f"for _ in range({4 * MAX_PROCESSES}):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    children.append(pid)\n"
        "print('forked', len(children))\n"
    )
    text = hostile(strict_tools, code, run_dir)
    assert "BlockingIOError" in text and "forked" not in text
    text = hostile(
        strict_tools,
        "import threading, time\n"
        f"for _ in range({4 * MAX_PROCESSES}):\n"
        "    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n",
        run_dir,
    )
    assert "can't start new thread" in text
    # The sleeping children died with the sandbox: a normal snippet runs right away.
    assert run(strict_tools.run("python", {"code": "print(1)"})).text == "1\n"


def test_connecting_outside_fails(strict_tools, run_dir):
    # (a listener on the host's 127.0.0.1: test_sandbox_hostile.py)
    text = hostile(
        strict_tools, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)", run_dir
    )
    assert "Network is unreachable" in text


def test_exhausting_memory_and_the_temporary_folder_fails(strict_tools, run_dir):
    text = hostile(strict_tools, "x = bytearray(1 << 30)\nprint(len(x))", run_dir)
    assert "MemoryError" in text
    text = hostile(strict_tools, "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))", run_dir)
    assert "MemoryError" in text
    # The private tmpfs is small (tmp_mb=8): filling it fails with ENOSPC, not the host's disk.
    text = hostile(
        strict_tools,
        "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))",
        run_dir,
    )
    assert "No space left on device" in text


def test_concurrent_snippets_each_get_their_own_sandbox(strict_tools):
    code = "import os\nopen('mine', 'w').write(str(os.getpid()))\nprint(sorted(os.listdir('.')))"

    async def many():
        return await asyncio.gather(*(strict_tools.run("python", {"code": code}) for _ in range(4)))

    results = run(many())
    assert [r.status for r in results] == ["ok"] * 4
    assert all(r.text == "['main.py', 'mine']\n" for r in results)


@pytest.mark.parametrize("mode", ["auto", "strict"])
def test_the_tool_refuses_to_start_without_bubblewrap(tmp_path, mode):
    with pytest.raises(SandboxUnavailable) as refused:
        Python(sandbox=mode, bwrap=str(tmp_path / "no-bwrap"))
    message = str(refused.value)  # what is missing and both ways out
    assert f"tools.python.sandbox={mode}: bubblewrap not found" in message
    assert "apt-get install -y bubblewrap" in message and "tools.python.sandbox=off" in message
    with pytest.raises(ValueError, match="auto, strict, off"):
        Python(sandbox="container")


def test_off_warns_runs_with_limits_and_is_counted(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_agent.envs.tools.python"):
        tool = Python(sandbox="off", memory_mb=256)
    assert not tool.sandboxed and tool.path.startswith("off+")
    assert "WITHOUT a sandbox" in caplog.text
    tools = ToolSet([tool])
    assert run(tools.run("python", {"code": "print(6 * 7)"})).text == "42\n"
    assert "MemoryError" in run(tools.run("python", {"code": "x = bytearray(1 << 30)"})).text
    metrics = sandbox_metrics(tools)
    assert (metrics["tool/unsandboxed"], metrics["tool/sandboxed"], metrics["tool/sandbox_path"]) == (
        2.0,
        0.0,
        0.0,
    )
    assert sandbox_metrics(tools)["tool/unsandboxed"] == 0.0  # per step


@needs_bwrap
def test_config_reaches_the_tool_through_the_factory():
    from megatron_agent.config import load_config
    from megatron_agent.rollout.factory import build_toolset

    cfg = load_config(
        None,
        [
            "tools.enabled=[python]",
            "tools.python.sandbox=strict",
            "tools.python.max_processes=4",
            "tools.python.memory_mb=300",
            "tools.python.tmp_mb=32",
            "tools.max_concurrent=3",
        ],
    )
    tools = build_toolset(cfg)
    tool = tools.tools["python"]
    got = (tool.mode, tool.max_processes, tool.memory_mb, tool.tmp_mb, tool.max_concurrent, tool.sandboxed)
    assert got == ("strict", 4, 300, 32, 3, True)
    assert run(tools.run("python", {"code": "print('hi')"})).text == "hi\n"
    metrics = sandbox_metrics(tools)
    assert (metrics["tool/unsandboxed"], metrics["tool/sandboxed"]) == (0.0, 1.0)
    off = make_tool("python", python_sandbox="off")
    assert not off.sandboxed and off.mode == "off"


@pytest.mark.parametrize(("timeout_s", "status"), [(2, "timeout"), (8, "ok")])
def test_the_python_tool_takes_tools_timeout_s(timeout_s, status):
    # A snippet sleeping 5 s: killed at tools.timeout_s=2, finished at 8 (the tool once kept its own 5 s).
    from megatron_agent.config import load_config
    from megatron_agent.rollout.factory import build_toolset

    cfg = load_config(None, ["tools.enabled=[python]", f"tools.timeout_s={timeout_s}"], validate=False)
    tools = build_toolset(cfg)
    assert tools.tools["python"].timeout_s == timeout_s
    result = run(tools.run("python", {"code": "import time\ntime.sleep(5)\nprint('slept')"}))
    assert result.status == status, result.text
    if status == "ok":
        assert result.text == "slept\n"
    else:
        assert result.seconds < 4, result.seconds
