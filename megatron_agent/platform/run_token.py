"""A run token on every process a run starts, so that none outlives its driver.

The driver sets `MEGATRON_AGENT_RUN_TOKEN` = "<driver pid>.<its start time in clock ticks>"
before it starts Ray: every process of the run inherits it (Ray's local cluster, its workers and
agents, vLLM engine cores, tool sandboxes), and shared-memory segments carry it in their names.
A token says whether its driver is alive without trusting a pid alone (pids wrap: the start
time must match too).

`start_reaper()` starts a small watcher in its own session: when the driver is gone, however it
ended (SIGKILL included), it kills every process carrying the token and removes the token's
shared-memory segments. `sweep_dead_runs()` does the same, at start-up, for the runs whose
driver and reaper both died (leftovers are found by token, not by pid).

    python megatron_agent/platform/run_token.py reap TOKEN    (what start_reaper runs)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TOKEN_ENV = "MEGATRON_AGENT_RUN_TOKEN"
SHM_DIR = Path("/dev/shm")
SHM_MARK = "megatron-agent-"
"""Shared-memory segments of a run are named `megatron-agent-...<token>...`."""


def start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_token(pid: int | None = None) -> str:
    """`<pid>.<start ticks>` of a process (default: this one): what `token_alive` checks."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{start_ticks(pid) or 0}"


def become_driver() -> str:
    """Make this process the driver of a run: its own token (replacing one it inherited) in its
    environment, and so in its children's; returns it."""
    os.environ[TOKEN_ENV] = process_token()
    return os.environ[TOKEN_ENV]


def current_token() -> str:
    """The run token this process inherited ('' outside a run)."""
    return os.environ.get(TOKEN_ENV, "")


def token_alive(token: str) -> bool:
    """True while the driver that made `token` runs (same pid and same start time)."""
    pid, _, ticks = token.partition(".")
    return pid.isdigit() and start_ticks(int(pid)) == ticks


def _environ_token(pid: int) -> str | None:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in data.split(b"\0"):
        if item.startswith(TOKEN_ENV.encode() + b"="):
            return item.split(b"=", 1)[1].decode(errors="replace")
    return None


def processes_of(token: str) -> list[int]:
    """Pids of the processes (other than this one) whose environment carries `token`."""
    return [pid for pid in _all_pids() if _environ_token(pid) == token]


def segments_of(token: str) -> list[Path]:
    """The shared-memory segments named with `token`."""
    if not SHM_DIR.is_dir():
        return []
    return [p for p in SHM_DIR.iterdir() if p.name.startswith(SHM_MARK) and token in p.name]


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # gone already
            pass


def kill_run(token: str, grace_s: float = 2.0) -> None:
    """SIGTERM every process of `token`, SIGKILL what is left after `grace_s`, remove its segments."""
    _signal(processes_of(token), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while processes_of(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(processes_of(token), signal.SIGKILL)
    for path in segments_of(token):
        path.unlink(missing_ok=True)


def sweep_dead_runs() -> list[str]:
    """Kill the processes and remove the segments of every run whose driver is gone; returns their tokens."""
    tokens = {t for pid in _all_pids() if (t := _environ_token(pid))}
    if SHM_DIR.is_dir():
        tokens |= {_token_in(p.name) for p in SHM_DIR.iterdir() if p.name.startswith(SHM_MARK)} - {""}
    dead = sorted(t for t in tokens if not token_alive(t))
    for token in dead:
        kill_run(token)
    return dead


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and int(p.name) != os.getpid()]


def _token_in(name: str) -> str:
    """The token in a segment name `megatron-agent-<kind>-<token>-<rest>` ('' for other names)."""
    for part in name[len(SHM_MARK) :].split("-"):
        pid, dot, ticks = part.partition(".")
        if dot and pid.isdigit() and ticks.isdigit():
            return part
    return ""


_REAPER: subprocess.Popen | None = None
"""This driver's reaper (one per driver process: its token is fixed by its pid and start time)."""


def start_reaper() -> subprocess.Popen:
    """Make this process a run's driver (`become_driver`) and start, once, the watcher that ends
    the run's processes when this process is gone, however it ends."""
    global _REAPER
    token = become_driver()
    if _REAPER is None or _REAPER.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}  # the reaper is not one of them
        _REAPER = subprocess.Popen(
            # this file as a script: standard library only (the package would import torch)
            [sys.executable, os.path.abspath(__file__), "reap", token],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a signal to the driver's process group does not reach it
        )
    return _REAPER


def _reap(token: str, poll_s: float = 0.5) -> None:
    while token_alive(token):
        time.sleep(poll_s)
    kill_run(token)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "reap":
        _reap(sys.argv[2])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
