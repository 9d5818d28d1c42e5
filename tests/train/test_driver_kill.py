"""Nothing is left behind when the driver dies, however it dies.

The driver's run token (`platform/run_token.py`) is in the environment of every process of the
run and in the name of its shared-memory segments; a reaper in its own session ends them once the
driver is gone. Drill: SIGKILL of the driver alone (not its process group) while the run holds in
a phase (`debug.hold_at`); within 10 s no process of the run and no segment of it remains. The
start-up sweep is tested on its own (a run whose driver and reaper both died).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_agent.platform.run_token import (
    SHM_DIR,
    TOKEN_ENV,
    processes_of,
    segments_of,
    start_ticks,
    sweep_dead_runs,
    token_alive,
)
from tests.conftest import REPO, TINY_SFT_RL, quickstart_train_cmd

TINY = [
    *TINY_SFT_RL,
    "sft.steps=0",
    "trainer.total_steps=2",
    "logging.plot=false",
    "sync.transport=shm",  # the sync's buckets live in /dev/shm segments
]


def _wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.25)
    return condition()


@pytest.mark.slow  # three trainer launches (about 50 s each on 2 cores); `make test-slow` runs them
@pytest.mark.parametrize("phase", ["rollout", "update", "save"])
def test_a_sigkilled_driver_leaves_no_process_and_no_segment(tmp_path, phase):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        quickstart_train_cmd(run_dir, *TINY, "checkpoint.save_freq=1", f"debug.hold_at={phase}:1"),
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    token = f"{proc.pid}.{start_ticks(proc.pid)}"
    try:
        held = _wait_until(lambda: (run_dir / f"held_{phase}_1").exists() or proc.poll() is not None, 600)
        assert held and proc.poll() is None, f"the run ended (rc {proc.returncode}) before the {phase}"
        assert len(processes_of(token)) >= 3, "Ray, the Megatron rank and the engine carry the token"
        assert segments_of(token), "the sync's shared-memory segments carry the token"
        proc.send_signal(signal.SIGKILL)  # the driver alone
        proc.wait()
        gone = _wait_until(lambda: not processes_of(token) and not segments_of(token), 10)
        assert gone, (processes_of(token), segments_of(token))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in processes_of(token):
            os.kill(pid, signal.SIGKILL)


def test_the_start_up_sweep_ends_runs_whose_driver_is_gone():
    # A token whose driver exited: a process carrying it is killed, its segment removed; a live
    # run's token (this process's own) is left alone.
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = f"{gone.stdout.strip()}.1"
    assert not token_alive(dead)
    alive = f"{os.getpid()}.{start_ticks(os.getpid())}"
    assert token_alive(alive)
    procs = {
        token: subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, TOKEN_ENV: token}
        )
        for token in (dead, alive)
    }
    segments = {token: SHM_DIR / f"megatron-agent-sync-{token}-123-0" for token in (dead, alive)}
    try:
        for path in segments.values():
            path.write_bytes(b"x")
        assert dead in sweep_dead_runs()
        assert procs[dead].wait(10) is not None and not segments[dead].exists()
        assert procs[alive].poll() is None and segments[alive].exists()
    finally:
        for p in procs.values():
            p.kill()
        for path in segments.values():
            path.unlink(missing_ok=True)
