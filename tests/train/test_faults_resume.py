"""Faults that stop a run, then `trainer.resume=auto` (issue 11 point 5), through `python -m
megatron_agent train` in a subprocess, two Megatron ranks (DP2), checkpoints on a small tmpfs:

1. a really full disk at the save after step 2 with `checkpoint.on_save_error=continue`: a
   warning naming the path, `checkpoint/save_errors` counts it, step 3 trains; the final save
   fails too, so the run exits 1 saying so; step 1's checkpoint is intact, no staging folder;
2. the tmpfs is grown; resume=auto continues from step 1, and rank 1 is SIGKILLed as soon as
   the step-2 checkpoint is published: the run stops with exit 1 and an error naming rank 1;
3. resume=auto continues from step 2 to the end (step 4), exit 0, every step logged once.

Three trainer starts (a few minutes on a loaded 2-core machine): marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, quickstart_train_cmd
from tests.train.test_faults import mount_tmpfs, umount

pytestmark = pytest.mark.slow

TINY = [
    "sft.steps=0",
    "parallel.dp=2",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "rollout.max_new_tokens=16",
    "data.num_synthetic_tasks=8",
    "data.num_synthetic_val_tasks=2",
    "trainer.total_steps=4",
    "trainer.test_freq=0",
    "trainer.worker_timeout_s=180",
    "logging.plot=false",
    "checkpoint.save_freq=1",
    "checkpoint.keep_last=1",
]


def _cmd(run_dir, save_dir, *extra):
    return quickstart_train_cmd(run_dir, *TINY, f"checkpoint.save_dir={save_dir}", *extra)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _pid_holding(log_path) -> int | None:
    """The pid of the process whose stdout is `log_path` (a Megatron worker of this test's run:
    the path is unique to it, so no other process on the machine can match), or None."""
    target = str(log_path)
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if os.readlink(fd_dir / "1") == target:
                return int(fd_dir.parent.name)
        except OSError:
            continue
    return None


@pytest.fixture
def tmpfs(tmp_path):
    save_dir = tmp_path / "ckpt"
    if not mount_tmpfs(save_dir, 18 << 20):
        pytest.skip("needs root to mount a small tmpfs (a really full disk)")
    yield save_dir
    umount(save_dir)


def test_full_disk_then_killed_worker_then_resume_to_the_end(tmp_path, tmpfs):
    run_dir, save_dir = tmp_path / "run", tmpfs
    # 1. full disk at the second save, on_save_error=continue
    proc = subprocess.run(
        _cmd(run_dir, save_dir, "trainer.total_steps=3", "checkpoint.on_save_error=continue"),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert f"saving the checkpoint of step 2 to {save_dir / 'step_000002'} failed" in proc.stderr
    assert "the disk is full" in proc.stderr and "training goes on" in proc.stderr
    assert "error: the final checkpoint (step 3) could not be saved" in proc.stderr
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["checkpoint/save_errors"] == 1.0  # the failed save of step 2, counted
    assert sorted(p.name for p in save_dir.iterdir()) == ["step_000001"]  # no staging folder left

    # 2. room again; resume, and SIGKILL rank 1 once step 2's checkpoint is published
    subprocess.run(["mount", "-o", "remount,size=256m", str(save_dir)], check=True)
    driver = subprocess.Popen(
        _cmd(run_dir, save_dir),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline, pid = time.time() + 900, None
    while not (save_dir / "step_000002").is_dir():  # published by a rename: complete once there
        assert driver.poll() is None, driver.communicate()
        assert time.time() < deadline, "step 2 was never saved"
        if pid is None:  # found ahead (once the resumed run's rank 1 is up): kill right after the save
            pid = _pid_holding(run_dir / "logs" / "megatron_1.log")
        time.sleep(0.05)
    pid = pid or _pid_holding(run_dir / "logs" / "megatron_1.log")
    assert pid is not None, "rank 1's process was not found"
    os.kill(pid, signal.SIGKILL)
    out, err = driver.communicate(timeout=600)
    assert driver.returncode == 1, err[-4000:]
    assert f"resumed from {save_dir / 'step_000001'} (step 1)" in out
    assert "error: megatron worker rank 1 died during" in err, err[-4000:]
    (last,) = [p.name for p in save_dir.iterdir()]  # keep_last=1: the newest the killed run saved

    # 3. resume again: from that checkpoint (step 2, or 3 if the kill came late) to the end
    proc = subprocess.run(
        _cmd(run_dir, save_dir), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert last in ("step_000002", "step_000003")
    assert f"resumed from {save_dir / last} (step {int(last[5:])})" in proc.stdout
    assert [r["step"] for r in _rows(run_dir)] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in save_dir.iterdir()) == ["step_000004"]
