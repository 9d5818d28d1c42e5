"""Deterministic mode: a run killed in the rollout, the update or a save, then resumed, repeats
the uninterrupted run: tokens and rewards exactly, log-prob and gradient quantities within 1e-5.

`trainer.deterministic=true` gives per-request sampling seeds, the lockstep engine schedule and
an empty prefix cache at each rollout. `debug.hold_at=PHASE:2` holds the run in that phase of
step 2; the test kills the whole process group with SIGKILL there (what a node failure or
`scancel --signal=KILL` does), then resumes with `trainer.resume=auto` from the step-1
checkpoint, in one run folder: killed in the rollout, then in the update, then in the save, then
resumed to the end. Every metric that is not a wall-clock time, and every rollout dump, must equal the
uninterrupted run's (step 1, from before the kill, checks that two runs agree at all).
"""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, TINY_QUICKSTART, quickstart_train_cmd
from tests.train.faulty_tools import calls_text

TINY = [
    *TINY_QUICKSTART,
    "trainer.total_steps=3",
    "checkpoint.save_freq=1",
    "trainer.deterministic=true",
    "logging.plot=false",
    "logging.progress_bars=false",
    # Every trajectory calls a tool that returns after a random 0-50 ms in its first turn, so
    # that the next turns reach the engine in an order that differs from run to run (without
    # the lockstep schedule and per-request seeds, two runs then sample different tokens).
    "tools.enabled=[calculator,tests.train.faulty_tools.Jitter]",
    f"debug.forced_first_turn={calls_text(['jitter'])}",
]
WALL_CLOCK = ("timing_s/", "perf/", "sync/seconds", "sync/gbps")
DUMP_FIELDS = ("uid", "response_ids", "token_source", "rollout_logprobs", "old_logprobs", "advantages")
# Quantities computed from log-probs and gradients. Three fresh-clone CI runs on the CI machine
# gave step-1 values that differed at the 1e-6 level (grad_norm 2.0161643 / 2.0161702 / 2.0161725,
# mismatch/* and the guard's log-ratio by about 5e-7) with every token, count, reward and
# advantage equal; 9 runs on the development machine, some with a CPU hog beside them, were
# bitwise equal, and the cause is not found. These are compared within FLOAT_TOL; everything
# else (tokens, provenance, uids, rewards, advantages, counts) must be equal.
FLOAT_NOISE = (
    "actor/grad_norm",
    "actor/pg_loss",
    "sft/loss",  # a mean log-prob: seen 1 ulp apart between two processes (6.6036438 vs 6.6036432)
    "actor/entropy",
    "actor/ppo_kl",
    "mismatch/",
    "guard/max_",
    "sync/probe_max_abs",
    "critic/kl",
)
FLOAT_TOL = dict(rel=1e-5, abs=1e-5)
LOGPROB_FIELDS = ("rollout_logprobs", "old_logprobs")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))  # workers import the tool


def _task_file(folder):
    """Arithmetic tasks that allow the jitter tool, with a reward that differs between samples
    (so that advantages, and hence the updates, are not zero for a random model)."""
    from megatron_agent.data.synthetic import arithmetic_tasks
    from megatron_agent.data.tasks import write_tasks

    tasks = arithmetic_tasks(8, seed=5)
    for task in tasks:
        task.tools = ["jitter"]
        task.reward = {"fn": "tests.train.faulty_tools.spread_reward", "ground_truth": "0"}
    folder.mkdir(parents=True, exist_ok=True)
    return write_tasks(folder / "train.jsonl", tasks)


def _cmd(run_dir, *overrides):
    tasks = _task_file(run_dir.parent / f"{run_dir.name}_tasks")
    return quickstart_train_cmd(run_dir, *TINY, f"data.train_path={tasks}", *overrides)


def _train(run_dir, *overrides, timeout=600):
    proc = subprocess.run(
        _cmd(run_dir, *overrides),
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


PHASES = ("rollout", "update", "save")


def _kill_when_held(run_dir, phase, *overrides):
    """Start a run that holds in `phase` of step 2, then SIGKILL its whole process group there."""
    marker = run_dir / f"held_{phase}_2"
    proc = subprocess.Popen(
        _cmd(run_dir, f"debug.hold_at={phase}:2", *overrides),
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
    marker.unlink()
    assert not (run_dir / "checkpoints" / "step_000002" / "manifest.json").exists(), phase


def test_a_run_killed_in_every_phase_in_turn_resumes_like_the_uninterrupted_run(uninterrupted, tmp_path):
    # One run folder: killed in the rollout of step 2, resumed from step 1 and killed in its
    # update, resumed and killed while its checkpoint is staged, then resumed to the end (4
    # launches instead of a fresh run per phase). Each resume starts at step 2 again.
    run_dir = tmp_path / "killed"
    _kill_when_held(run_dir, PHASES[0])
    for phase in PHASES[1:]:
        _kill_when_held(run_dir, phase, "trainer.resume=auto")
    out = _train(run_dir, "trainer.resume=auto").stdout
    assert "continuing at step 2" in out, out[-2000:]
    metrics, dumps = _comparable(run_dir)
    assert sorted(metrics) == sorted(uninterrupted[0])  # every step once, none lost or repeated
    assert all(m["tool/calls"] >= 4 for step, m in metrics.items() if step >= 1)  # jitter ran
    assert all(m["critic/advantages/max"] > 0 for step, m in metrics.items() if step >= 1)  # updates moved
    for step in (1, 2, 3):
        _assert_same_step(metrics[step], uninterrupted[0][step], step)
        _assert_same_dump(dumps[step], uninterrupted[1][step], step)


def _split(metrics: dict) -> tuple[dict, dict]:
    """(exact, float-noise) parts of one step's metrics (see FLOAT_NOISE)."""
    noisy = {k: v for k, v in metrics.items() if k.startswith(FLOAT_NOISE)}
    return {k: v for k, v in metrics.items() if k not in noisy}, noisy


def _assert_same_step(got: dict, want: dict, step: int) -> None:
    """Every metric equal, except log-prob/gradient quantities within FLOAT_TOL."""
    got_exact, got_noisy = _split(got)
    want_exact, want_noisy = _split(want)
    assert got_exact == want_exact, step
    assert got_noisy == pytest.approx(want_noisy, **FLOAT_TOL), step


def _assert_same_dump(got: list, want: list, step: int) -> None:
    """Every dump field equal, except the log-probs within FLOAT_TOL."""

    def without_logprobs(rows):
        return [{k: v for k, v in r.items() if k not in LOGPROB_FIELDS} for r in rows]

    assert without_logprobs(got) == without_logprobs(want), step
    for field in LOGPROB_FIELDS:
        for a, b in zip(got, want, strict=True):
            assert [x is None for x in a[field]] == [x is None for x in b[field]], (step, field)
            pairs = [(x, y) for x, y in zip(a[field], b[field], strict=True) if x is not None]
            assert [x for x, _ in pairs] == pytest.approx([y for _, y in pairs], **FLOAT_TOL), (step, field)


def test_the_comparison_catches_a_different_token_and_a_moved_logprob():
    """The tolerant comparison still fails on what determinism is about."""
    step = {"tool/calls": 4.0, "actor/grad_norm": 2.0161702, "critic/score/mean": 0.575}
    _assert_same_step(dict(step, **{"actor/grad_norm": 2.0161643}), step, 1)  # CI-machine noise passes
    with pytest.raises(AssertionError):
        _assert_same_step(dict(step, **{"critic/score/mean": 0.5750001}), step, 1)
    with pytest.raises(AssertionError):
        _assert_same_step(dict(step, **{"actor/grad_norm": 2.02}), step, 1)
    row = {
        "uid": "a/0",
        "response_ids": [5, 6],
        "rollout_logprobs": [-1.0, None],
        "old_logprobs": [-1.0, -2.0],
    }
    _assert_same_dump([dict(row, rollout_logprobs=[-1.0000005, None])], [row], 1)
    with pytest.raises(AssertionError):
        _assert_same_dump([dict(row, response_ids=[5, 7])], [row], 1)
    with pytest.raises(AssertionError):
        _assert_same_dump([dict(row, old_logprobs=[-1.0, -2.01])], [row], 1)
