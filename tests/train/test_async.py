"""Asynchronous RL on the real stack (deterministic mode, the jittering tool of the resume tests).

- staleness 0 is the synchronous run: `trainer.mode=async async.max_staleness=0` against
  `trainer.mode=sync` with the same knobs (the decoupled loss in both): the same rollout dumps
  (tokens, provenance, policy versions, masks) and the same metrics, bar the async-only ones;
  likewise with PPO's critic (slow);
- eta = 1 (slow): every trained token at most one version old, some exactly one (the engines
  generated ahead); each sync interrupts the batch generating ahead at a fixed engine step, its
  requests continue under the new weights, and their tokens agree with the trainer at the new
  version; a run killed in a rollout, an update and a save in turn and resumed, and a run
  stopped by SIGTERM and resumed, equal the uninterrupted one (the checkpoint keeps the
  admitted, untrained batch);
- eta = 2 (slow): two versions behind at most; an engine killed while the actor updates (slow).
"""

import json
import subprocess
import time

import pytest

from tests.conftest import REPO, sigterm_after_step_1
from tests.train.test_deterministic_resume import (
    _assert_same_dump,
    _assert_same_step,
    _cmd,
    _env,
    _kill_when_held,
    _train,
)

STEPS = 4
DECOUPLED = ["algorithm.off_policy_loss=decoupled", f"trainer.total_steps={STEPS}", "checkpoint.save_freq=0"]
ASYNC_ONLY = ("async/", "mismatch/staleness_")  # metrics that only an async run reports
DUMP_FIELDS = (
    "uid",
    "response_ids",
    "token_source",
    "loss_mask",
    "policy_versions",
    "rollout_logprobs",
    "old_logprobs",
    "advantages",
    "values",
)


def _comparable(run_dir):
    """{step: metrics without wall-clock and async-only keys}, {step: dump rows}."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = {
        r["step"]: {
            k: v
            for k, v in r.items()
            if not k.startswith(("timing_s/", "perf/", "sync/seconds", "sync/gbps", *ASYNC_ONLY))
            and not k.endswith("_s")
        }
        for r in rows
    }
    dumps = {}
    for step in range(1, STEPS + 1):
        lines = (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
        dumps[step] = [{k: json.loads(line).get(k) for k in DUMP_FIELDS} for line in lines]
    return metrics, dumps, rows


def _versions(dump_rows) -> set[int]:
    return {v for row in dump_rows for v in row["policy_versions"] if v is not None}


def test_staleness_0_is_the_synchronous_run(tmp_path):
    _assert_staleness_0_is_the_synchronous_run(tmp_path)


def test_staleness_0_with_a_critic_is_the_synchronous_run(tmp_path):
    """PPO's critic in async mode (its values from its update's forward, as in sync mode)."""
    dumps = _assert_staleness_0_is_the_synchronous_run(
        tmp_path, "algorithm.adv_estimator=gae", "critic.lr=1e-3"
    )
    assert all(row["values"] for step in dumps for row in dumps[step])  # compared above, with the rest
    rows = [json.loads(line) for line in (tmp_path / "async0" / "metrics.jsonl").read_text().splitlines()]
    assert all("critic/vf_loss" in r and r["critic/guard_skipped"] == 0.0 for r in rows if r["step"] >= 1)


def _assert_staleness_0_is_the_synchronous_run(tmp_path, *overrides):
    _train(tmp_path / "sync", *DECOUPLED, *overrides)
    _train(tmp_path / "async0", *DECOUPLED, *overrides, "trainer.mode=async", "async.max_staleness=0")
    sync, async0 = _comparable(tmp_path / "sync"), _comparable(tmp_path / "async0")
    assert sorted(sync[0]) == sorted(async0[0])
    for step in sync[0]:
        _assert_same_step(async0[0][step], sync[0][step], step)
    for step in range(1, STEPS + 1):
        _assert_same_dump(async0[1][step], sync[1][step], step)
        assert _versions(sync[1][step]) == {step}, step  # step k samples with the weights of k - 1 updates
    rows = {r["step"]: r for r in async0[2]}
    assert all(rows[s]["async/staleness/max"] == 0 for s in range(1, STEPS + 1))
    assert rows[STEPS]["async/admitted_groups"] == 2 * STEPS  # data.train_batch_size=2 per step
    assert all(m["critic/advantages/max"] > 0 for s, m in sync[0].items() if s >= 1)  # updates moved
    return async0[1]


ETA1 = [
    "trainer.mode=async",
    "async.max_staleness=1",
    "async.interrupt_after_engine_steps=6",
    "checkpoint.save_freq=1",
]


@pytest.fixture(scope="module")
def eta1(tmp_path_factory):
    """The uninterrupted eta = 1 run (compared with the killed and the signalled ones)."""
    run_dir = tmp_path_factory.mktemp("async") / "uninterrupted"
    _train(run_dir, *DECOUPLED, *ETA1)
    return _comparable(run_dir)


def _assert_same_run(got, want) -> None:
    assert sorted(got[0]) == sorted(want[0])  # every step once, none lost or repeated
    for step in range(1, STEPS + 1):
        _assert_same_step(got[0][step], want[0][step], step)
        _assert_same_dump(got[1][step], want[1][step], step)


def test_eta_1_trains_one_version_behind_and_resumes_exactly(eta1, tmp_path):
    metrics = {r["step"]: r for r in eta1[2]}
    for step in range(1, STEPS + 1):
        versions = _versions(eta1[1][step])
        assert min(versions) >= step - 1, (step, versions)  # the bound, read from the dumps
        if step >= 2:
            # Generated while step - 1 trained, interrupted by its sync after 6 engine steps: every
            # request in flight switches from version step - 1 to step at the same token.
            assert versions == {step - 1, step}, (step, versions)
            for row in eta1[1][step]:
                sampled = [v for v in row["policy_versions"] if v is not None]
                assert sampled == sorted(sampled), row["uid"]  # one switch, never back
            assert metrics[step]["async/interrupted_requests"] > 0
            # Tokens sampled after the interruption: the trainer's weights (fp32, recomputed KV).
            assert metrics[step]["mismatch/staleness_0/abs_diff_mean"] < 1e-3
            assert metrics[step]["mismatch/staleness_1/abs_diff_mean"] > 1e-2
        # The samples of a prompt differ (an async stack that reset the RNG made them identical).
        groups: dict[str, list] = {}
        for row in eta1[1][step]:
            groups.setdefault(row["uid"].rsplit("/", 1)[0], []).append(row["response_ids"])
        assert any(len({tuple(r) for r in rows}) > 1 for rows in groups.values()), step
    # One run folder killed in turn: in batch 2's rollout (it runs while step 1 updates, before
    # any checkpoint), in step 2's update (the step-1 checkpoint holds batch 2: admitted,
    # generated, untrained; a resume must train it, not regenerate it under newer weights), and
    # while step 2's checkpoint is staged; then resumed to the end.
    run_dir = tmp_path / "killed"
    for k, phase in enumerate(("rollout", "update", "save")):
        _kill_when_held(run_dir, phase, *DECOUPLED, *ETA1, *(["trainer.resume=auto"] if k else []))
    _train(run_dir, *DECOUPLED, *ETA1, "trainer.resume=auto")
    _assert_same_run(_comparable(run_dir), eta1)


def test_sigterm_saves_the_admitted_batch_exits_0_and_resumes_exactly(eta1, tmp_path):
    run_dir = tmp_path / "signalled"
    stopped = sigterm_after_step_1(_cmd(run_dir, *DECOUPLED, *ETA1), run_dir, _env(), timeout=600)
    out = stopped.stdout
    assert stopped.returncode == 0, f"{out[-2000:]}\n{stopped.stderr[-4000:]}"
    stop = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert 1 <= stop < STEPS
    driver = json.loads(
        (run_dir / "checkpoints" / f"step_{stop:06d}" / "trainer" / "driver.json").read_text()
    )
    assert [b["step"] for b in driver["async"]["batches"]] == [stop + 1]  # generated, not yet trained
    _train(run_dir, *DECOUPLED, *ETA1, "trainer.resume=auto")
    _assert_same_run(_comparable(run_dir), eta1)


def test_eta_1_with_a_critic_stopped_by_sigterm_resumes_exactly(tmp_path):
    """PPO's critic at eta = 1: its weights, optimizer and schedule and the admitted batch in the
    checkpoint; the resumed run repeats the uninterrupted one (values included)."""
    gae = ["algorithm.adv_estimator=gae", "critic.lr=1e-3"]
    _train(tmp_path / "uninterrupted", *DECOUPLED, *ETA1, *gae)
    want = _comparable(tmp_path / "uninterrupted")
    run_dir = tmp_path / "signalled"
    stopped = sigterm_after_step_1(_cmd(run_dir, *DECOUPLED, *ETA1, *gae), run_dir, _env(), timeout=600)
    assert stopped.returncode == 0, f"{stopped.stdout[-2000:]}\n{stopped.stderr[-4000:]}"
    assert (run_dir / "checkpoints" / "step_000001" / "critic" / "update.pt").is_file()
    _train(run_dir, *DECOUPLED, *ETA1, *gae, "trainer.resume=auto")
    _assert_same_run(_comparable(run_dir), want)
    assert all(row["values"] for step in want[1] for row in want[1][step])


def test_an_engine_killed_while_the_actor_updates_rolls_out_again_under_honest_versions(tmp_path):
    # eta = 1: batch 4 generates (at version 3) while step 3 updates. Engine 0 kills itself in
    # that rollout; the check before step 3's sync finds it dead, starts a new engine and syncs
    # the updated weights into every engine as version 4 (not as 3: the actor moved on), and
    # engine 0's share of batch 4 is rolled out again under them.
    run_dir = tmp_path / "killed_engine"
    mode = ["trainer.mode=async", "async.max_staleness=1", "rollout.num_engines=2", "actor.lr=1e-3"]
    _train(run_dir, *DECOUPLED, *mode, "debug.kill_engine_at_step=3")
    metrics, dumps, rows = _comparable(run_dir)
    last = {r["step"]: r for r in rows}
    assert last[STEPS]["rollout/engine_restarts"] == 1
    engine0, engine1 = dumps[4][:2], dumps[4][2:]  # one prompt per engine, rollout.n=2 each
    # Engine 0's share rolled again after the new weights went in; engine 1's began at version
    # 3, and the sync that the replacement made interrupted it (its later tokens: version 4).
    assert _versions(engine0) == {4} and 3 in _versions(engine1) <= {3, 4}
    # Labelled 4, sampled by the weights that step 4 trains from: engine and trainer agree.
    assert last[4]["mismatch/staleness_0/abs_diff_mean"] < 1e-4
    assert last[4]["mismatch/staleness_1/abs_diff_mean"] > 10 * last[4]["mismatch/staleness_0/abs_diff_mean"]


def test_eta_2_trains_two_versions_behind_at_most(tmp_path):
    run_dir = tmp_path / "eta2"
    _train(run_dir, *DECOUPLED, "trainer.mode=async", "async.max_staleness=2")
    _, dumps, rows = _comparable(run_dir)
    for step in range(1, STEPS + 1):
        # Batch k is admitted at the start of step k - 2 (version k - 2), or at the start, and
        # from k = 3 on the sync after update k - 2 interrupts it (then version k - 1).
        assert _versions(dumps[step]) == ({1} if step <= 2 else {step - 2, step - 1}), step
    assert max(r.get("async/staleness/max", 0) for r in rows) == 2


def test_a_sync_that_cannot_complete_names_the_engine_and_exits(tmp_path):
    # eta = 1: batch 2 generates while step 1 updates; the engine's thread is held forever in that
    # rollout (debug.hold_at), so the sync after step 1 can never load its buckets there. The run
    # must stop with an error naming the engine once sync.timeout_s has passed: never a hang.
    run_dir = tmp_path / "stuck"
    start = time.monotonic()
    proc = subprocess.run(
        _cmd(
            run_dir,
            *DECOUPLED,
            "trainer.mode=async",
            "async.max_staleness=1",
            "debug.hold_at=rollout:2",
            "sync.timeout_s=20",
        ),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rollout engine 0 did not answer 'load_bucket' within 20 s" in proc.stderr, proc.stderr[-3000:]
    held = (run_dir / "held_rollout_2").stat().st_mtime
    assert time.time() - held < 20 + 90, "the run took far longer than the sync timeout to stop"
    assert time.monotonic() - start < 400
