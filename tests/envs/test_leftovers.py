"""What a process killed while its python-tool calls ran left (their cgroups, an unsandboxed call's
working folder) is removed by the next process that makes the tool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_agent.envs.tools import cgroups
from megatron_agent.envs.tools.python import remove_orphaned_workdirs

# A process that makes a call's cgroups, starts the call's process in them and dies (SIGKILL)
# without closing them: what a trainer killed while a tool call ran leaves behind.
DIES_WITH_A_CALL = """
import os, signal, subprocess, sys
from megatron_agent.envs.tools import cgroups
cg = cgroups.CallCgroup(64 << 20, 8)
child = subprocess.Popen(
    ["sleep", "60"], preexec_fn=cg.enter, start_new_session=True,
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
print(cg.memory_dir.name, child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie counts: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _kill_processes_with(text: str) -> None:
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


@pytest.fixture
def where():
    found = cgroups.support()
    if found is None:
        pytest.skip("needs writable memory and pids cgroups")
    return found


def test_a_dead_owners_call_cgroups_are_removed_and_their_processes_killed(where):
    proc = subprocess.run(
        [sys.executable, "-c", DIES_WITH_A_CALL], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    name, pid = proc.stdout.split()
    dirs = [parent / name for parent in set(where.parents.values())]
    assert all(d.is_dir() for d in dirs) and not _gone(int(pid)), "the dead owner left nothing behind"
    # the same dead pid in another pid namespace (a container sharing this cgroup): not ours
    namespace = cgroups.owner_tag().partition("_")[0]
    foreign = [
        p / name.replace(f"_{namespace}_", f"_{int(namespace) + 1}_", 1) for p in set(where.parents.values())
    ]
    for folder in foreign:
        folder.mkdir()

    try:
        removed = cgroups.remove_orphans(where)
        assert all(f.is_dir() for f in foreign), "another pid namespace's cgroup was removed"
    finally:
        for folder in foreign:
            folder.rmdir()
    assert name in removed and not any(d.exists() for d in dirs), removed
    deadline = time.monotonic() + 5
    while not _gone(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _gone(int(pid)), "the orphaned call's process still runs"

    live = cgroups.CallCgroup(64 << 20, 8, where)  # this process's own call: not an orphan
    try:
        assert cgroups.remove_orphans(where) == []
        assert live.memory_dir.is_dir() and live.pids_dir.is_dir()
    finally:
        live.close()
    assert not live.memory_dir.exists() and not live.pids_dir.exists()


def test_the_first_call_of_a_process_sweeps_the_orphans(where):
    proc = subprocess.run(
        [sys.executable, "-c", DIES_WITH_A_CALL], capture_output=True, text=True, timeout=60
    )
    name = proc.stdout.split()[0]
    dirs = [parent / name for parent in set(where.parents.values())]
    assert all(d.is_dir() for d in dirs)
    code = "from megatron_agent.envs.tools import cgroups\ncg = cgroups.CallCgroup(64 << 20, 8)\ncg.close()\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=dict(os.environ))
    assert not any(d.exists() for d in dirs)


# A process whose unsandboxed call (no cgroup) writes into its working folder and is still running
# when the process is killed.
DIES_IN_AN_UNSANDBOXED_CALL = """
import asyncio, glob, os, signal, sys, tempfile
from megatron_agent.envs.tools import cgroups
from megatron_agent.envs.tools.python import Python
tool = Python(sandbox="off", use_cgroup=False, timeout_s=30)
async def main():
    call = asyncio.ensure_future(tool.call("open('written', 'w').write('x' * 1000)\\nimport time\\ntime.sleep(30)"))
    pattern = os.path.join(tempfile.gettempdir(), f"ma_python_{cgroups.owner_tag()}_*", "written")
    while not glob.glob(pattern):
        await asyncio.sleep(0.01)
    print(os.path.basename(os.path.dirname(glob.glob(pattern)[0])), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
asyncio.run(main())
"""


def test_a_dead_owners_unsandboxed_working_folder_is_removed_when_the_next_tool_is_made(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", DIES_IN_AN_UNSANDBOXED_CALL], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    workdir = Path(tempfile.gettempdir()) / proc.stdout.strip()
    _kill_processes_with(workdir.name)  # the snippet outlives its owner on the `off` path
    assert (workdir / "written").read_text() == "x" * 1000, "the killed call left no folder"
    namespace, _, pid = cgroups.owner_tag().partition("_")
    dead = proc.stdout.strip().split("_")[3]  # ma_python_<namespace>_<pid>_...
    kept = [
        f"ma_python_{namespace}_{pid}_live",  # a live owner's
        f"ma_python_{int(namespace) + 1}_{dead}_other",  # a dead pid of another pid namespace
        "ma_python_unrelated",
    ]
    for name in kept + [f"ma_python_{namespace}_{dead}_gone"]:
        (tmp_path / name).mkdir()
    assert remove_orphaned_workdirs(str(tmp_path)) == [f"ma_python_{namespace}_{dead}_gone"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    reused = f"ma_python_{namespace}_{os.getpid()}.1_reused"  # a live pid, another start: its owner died
    (tmp_path / reused).mkdir()
    assert remove_orphaned_workdirs(str(tmp_path)) == [reused]
    code = "from megatron_agent.envs.tools.python import Python\nPython(sandbox='off', use_cgroup=False)\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert not workdir.exists()
