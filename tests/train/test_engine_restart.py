"""A rollout engine's process killed mid-rollout (issue 11 point 5) on the real stack: Ray, one
Megatron rank over gloo and two vLLM engines, driven step by step from this process.

At RL step 2 of 3, engine 0's process SIGKILLs itself after a few engine steps of its rollout
(`debug.kill_engine_at_step`). The trainer starts a new engine with the same rank, reconnects the
actor's senders, syncs the current weights into every engine (verified) at the version they had,
and rolls out engine 0's whole share again; engine 1's trajectories are kept. Then, in the same
session: an exception raised inside an engine is an error, not a restart, and a death beyond
`rollout.max_engine_restarts` stops with the named error.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.conftest import REPO, read_dump

KILL_STEP, NUM_STEPS, N = 2, 3, 2
TINY = [
    "sft.steps=0",
    "parallel.dp=1",
    "rollout.num_engines=2",
    "data.train_batch_size=2",  # one prompt per engine
    "actor.ppo_mini_batch_size=2",
    "actor.lr=1e-3",  # with the spread reward every step moves the weights: a stale engine would show
    f"rollout.n={N}",
    "rollout.max_new_tokens=24",
    "data.num_synthetic_val_tasks=2",
    "logging.plot=false",
    "trainer.worker_timeout_s=180",
    f"trainer.total_steps={NUM_STEPS}",
    f"debug.kill_engine_at_step={KILL_STEP}",
]


def _task_file(folder):
    from megatron_agent.data.synthetic import arithmetic_tasks
    from megatron_agent.data.tasks import write_tasks

    tasks = arithmetic_tasks(4, seed=5)
    for task in tasks:  # rewards that differ within a group: non-zero advantages for a random model
        task.reward = {"fn": "tests.train.faulty_tools.spread_reward", "ground_truth": "0"}
    return write_tasks(folder / "train.jsonl", tasks)


def _engine_pids(t) -> list[int]:
    return t.engines.call("sync_call", "ping")  # the receiver answers with its process id


@pytest.fixture(scope="module")
def drill(tmp_path_factory, repo_on_pythonpath):
    from megatron_agent.config import config_to_dict, load_config
    from megatron_agent.train.cluster import WorkerDiedError, WorkerError, ray_cluster
    from megatron_agent.train.rl_loop import rl_step
    from megatron_agent.train.run_log import RunLogger
    from megatron_agent.train.run_state import rollout_seed
    from megatron_agent.train.trainer import Trainer

    root = tmp_path_factory.mktemp("engine_restart")
    run_dir = root / "run"
    overrides = [*TINY, f"trainer.run_dir={run_dir}", f"data.train_path={_task_file(root)}"]
    cfg = load_config(REPO / "examples/quickstart/config.yaml", overrides)
    out: dict = {"run_dir": run_dir, "rows": [], "pids": []}
    t = Trainer(cfg)
    run_log = RunLogger(run_dir, cfg.logging, config_dict=config_to_dict(cfg))
    with ray_cluster(cfg.ray.address, cfg.ray.num_cpus):
        try:
            t.start()
            t.make_update(NUM_STEPS)
            out["first_sync"] = t.sync()
            run_log.log(0, out["first_sync"])
            for step in range(1, NUM_STEPS + 1):
                out["pids"].append(_engine_pids(t))
                t.reseed_engines(rollout_seed(cfg.rollout.seed, step))
                row = rl_step(t, step)
                run_log.log(step, row)
                out["rows"].append(row)
            out["pids"].append(_engine_pids(t))
            out["final_versions"] = t.engines.call("weight_version")

            # An exception inside an engine (a bad task) stays an error: no restart.
            try:
                t.rollout([None, t.train_tasks[0]], 1)
            except WorkerError as exc:
                out["raised"] = exc
            out["restarts_after_raise"] = t.engine_restarts
            # A death beyond the bound stops with the named error.
            cfg.rollout.max_engine_restarts = 0
            victim = out["pids"][-1][1]
            os.kill(victim, signal.SIGKILL)
            try:
                t.rollout(t.train_tasks[:2], 1)
            except WorkerDiedError as exc:
                out["bound_error"], out["victim"] = exc, victim
        finally:
            run_log.close()
            t.close()
    return out


def test_killed_engine_is_replaced_synced_and_its_prompts_rolled_out_again(drill):
    rows, pids, run_dir = drill["rows"], drill["pids"], drill["run_dir"]
    print("timing_s/gen per step:", [round(r["timing_s/gen"], 2) for r in rows])  # shown with -s
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0, 1.0]  # cumulative
    assert all(r["sync/verified"] == 1.0 for r in rows)
    # Engine 0 died during step 2 and was replaced; engine 1 and the replacement lived on.
    assert pids[0] == pids[1] and pids[2][0] != pids[1][0] and pids[2][1] == pids[1][1]
    assert pids[3] == pids[2]  # the replacement did not kill itself again at step 3
    assert (run_dir / "debug" / f"engine_killed_at_step_{KILL_STEP}").read_text() == f"pid {pids[1][0]}\n"
    log = (run_dir / "logs" / "rollout_0.log").read_text()
    assert f"debug.kill_engine_at_step={KILL_STEP}: engine 0 (pid {pids[1][0]}) kills itself" in log

    # The version count goes on as in an uninterrupted run: the rollout of step N runs on version N.
    assert drill["first_sync"]["sync/weight_version"] == 1.0
    assert [r["sync/weight_version"] for r in rows] == [2.0, 3.0, 4.0]
    assert drill["final_versions"] == [4, 4]
    for step in range(1, NUM_STEPS + 1):
        trajs = read_dump(run_dir, step)
        assert len(trajs) == 2 * N  # every prompt's full group, none lost with the dead engine
        assert len({tr["uid"] for tr in trajs}) == 2 * N
        assert all(tr["weight_version"] == step for tr in trajs), [tr["weight_version"] for tr in trajs]


def test_the_new_engine_computes_with_the_actors_weights(drill):
    assert all(r["actor/grad_norm"] > 0 for r in drill["rows"])  # every step changed the weights
    row = drill["rows"][KILL_STEP - 1]
    assert row["mismatch/max_abs_diff"] < 1e-3, row["mismatch/max_abs_diff"]
    # The re-rolled share (engine 0 has task 0: the first N trajectories), token by token.
    for tr in read_dump(drill["run_dir"], KILL_STEP)[:N]:
        pairs = [(o, r) for o, r, m in zip(tr["old_logprobs"], tr["rollout_logprobs"], tr["loss_mask"]) if m]
        assert pairs and max(abs(o - r) for o, r in pairs) < 1e-3


def test_an_exception_in_an_engine_is_an_error_not_a_restart(drill):
    from megatron_agent.train.cluster import WorkerDiedError

    exc = drill.get("raised")
    assert exc is not None and not isinstance(exc, WorkerDiedError)
    assert "rollout worker rank 0 raised in collect()" in str(exc)  # the rollout's own error
    assert drill["restarts_after_raise"] == 1


def test_a_death_beyond_max_engine_restarts_stops_with_the_named_error(drill):
    exc = drill.get("bound_error")
    assert exc is not None, "the engine's death did not stop the rollout"
    assert exc.rank == 1 and exc.pid == drill["victim"]
    message = str(exc)
    assert re.search(r"rollout worker rank 1 died during (start_rollout|collect)\(\)", message), message
    assert f"pid: {drill['victim']}" in message
    assert "rollout.max_engine_restarts=0 reached (1 engines replaced in this run)" in message


class Mortal:
    """A worker that can die on request (the drill's Ray session is over by now)."""

    def __init__(self, rank, world, log_path):
        from megatron_agent.train.cluster import redirect_output

        redirect_output(log_path)
        self.rank = rank
        print(f"rank {rank} up as pid {os.getpid()}", flush=True)

    def work(self, die: bool):
        if die and self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.rank, os.getpid()


def test_worker_group_names_a_death_and_replaces_the_worker(tmp_path):
    from megatron_agent.train.cluster import WorkerDiedError, WorkerGroup, start_ray, stop_ray

    started = start_ray(num_cpus=2)
    group = WorkerGroup(Mortal, 2, name="mortal", log_dir=tmp_path, num_cpus=0, timeout_s=60)
    try:
        (_, pid0), (_, pid1) = group.call("work", False)
        with pytest.raises(WorkerDiedError) as err:
            group.call("work", True)
        assert err.value.rank == 1 and err.value.pid == pid1
        assert "mortal worker rank 1 died during work()" in str(err.value)
        group.replace(1)
        (_, again0), (rank1, new1) = group.call("work", False)
        assert again0 == pid0 and rank1 == 1 and new1 != pid1  # same rank, a new process
        log = (tmp_path / "mortal_1.log").read_text()
        assert f"rank 1 up as pid {pid1}" in log and f"rank 1 up as pid {new1}" in log  # one log, appended
    finally:
        group.kill()
        if started:
            stop_ray()
