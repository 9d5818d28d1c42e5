"""Deterministic mode: a run killed in the rollout, the update or a save, then resumed, repeats
the uninterrupted run bitwise (issue: exact resume).

`trainer.deterministic=true` gives per-request sampling seeds, the lockstep engine schedule and
an empty prefix cache at each rollout. `debug.hold_at=PHASE:2` holds the run in that phase of
step 2; the test kills the whole process group with SIGKILL there (what a node failure or
`scancel --signal=KILL` does), then resumes with `trainer.resume=auto` from the step-1
checkpoint. Every metric that is not a wall-clock time, and every rollout dump, must equal the
uninterrupted run's.
"""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, quickstart_train_cmd

TINY = [
    "sft.steps=2",
    "sft.num_synthetic=32",
    "sft.batch_size=8",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "rollout.max_new_tokens=24",
    "data.num_synthetic_val_tasks=2",
    "trainer.total_steps=3",
    "trainer.test_freq=0",
    "checkpoint.save_freq=1",
    "trainer.deterministic=true",
    "logging.plot=false",
    "logging.progress_bars=false",
]
WALL_CLOCK = ("timing_s/", "perf/", "sync/seconds", "sync/gbps")
DUMP_FIELDS = ("uid", "response_ids", "token_source", "rollout_logprobs", "old_logprobs", "advantages")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1")


def _train(run_dir, *overrides, timeout=600):
    proc = subprocess.run(
        quickstart_train_cmd(run_dir, *TINY, *overrides),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _comparable(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = {
        r["step"]: {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK) and not k.endswith("_s")}
        for r in rows
    }
    dumps = {}
    for step in (1, 2, 3):
        lines = (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
        dumps[step] = [{k: json.loads(line).get(k) for k in DUMP_FIELDS} for line in lines]
    return metrics, dumps


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("det") / "uninterrupted"
    _train(run_dir)
    return _comparable(run_dir)


def test_deterministic_mode_repeats_a_run_bitwise(uninterrupted, tmp_path):
    run_dir = tmp_path / "again"
    _train(run_dir)
    assert _comparable(run_dir) == uninterrupted


@pytest.mark.parametrize("phase", ["rollout", "update", "save"])
def test_a_run_killed_in_any_phase_resumes_bitwise(uninterrupted, tmp_path, phase):
    run_dir = tmp_path / f"killed_in_{phase}"
    marker = run_dir / f"held_{phase}_2"
    proc = subprocess.Popen(
        quickstart_train_cmd(run_dir, *TINY, f"debug.hold_at={phase}:2"),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the kill reaches the driver and Ray
    )
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before reaching {phase}"
            assert time.monotonic() < deadline, f"the run never reached the {phase} of step 2"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (run_dir / "checkpoints" / "step_000002" / "manifest.json").exists()
    out = _train(run_dir, "trainer.resume=auto").stdout
    assert "continuing at step 2" in out, out[-2000:]
    metrics, dumps = _comparable(run_dir)
    assert sorted(metrics) == sorted(uninterrupted[0])  # every step once, none lost or repeated
    for step in (1, 2, 3):
        assert metrics[step] == uninterrupted[0][step], step
        assert dumps[step] == uninterrupted[1][step], step
