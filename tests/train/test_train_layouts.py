"""The RL loop at TP2PP1, TP1PP2 (with VPP) and with two data-parallel ranks, and every estimator.

The driver runs in the test process (`Trainer` + `rl_step`); Megatron ranks and the vLLM engine
are Ray actors, as in `train`. After each step the sync is verified (checksums and a probe of
engine against actor log-probs), and rollout log-probs agree with the trainer's old log-probs.
"""

import math

import pytest

from megatron_agent.config import load_config
from megatron_agent.train.cluster import ray_cluster
from megatron_agent.train.rl_loop import rl_step
from megatron_agent.train.trainer import Trainer
from tests.conftest import REPO

TINY = [
    "sft.steps=0",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=1",
    "rollout.n=2",
    "rollout.max_new_tokens=16",
    "rollout.max_turns=2",
    "data.num_synthetic_val_tasks=2",
    "logging.plot=false",
    "actor.lr=1e-3",
]
ESTIMATORS = ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]


def _session(tmp_path, overrides, steps):
    cfg = load_config(
        REPO / "examples/quickstart/config.yaml", [*TINY, f"trainer.run_dir={tmp_path}", *overrides]
    )
    t = Trainer(cfg)
    rows = []
    with ray_cluster(cfg.ray.address, cfg.ray.num_cpus):
        try:
            t.start()
            t.make_update(len(steps))
            first = t.sync()
            assert first["sync/verified"] == 1.0
            for step, estimator in enumerate(steps, start=1):
                t.cfg.algorithm.adv_estimator = estimator
                rows.append(rl_step(t, step))
        finally:
            t.close()
    for row in rows:
        assert row["sync/verified"] == 1.0 and row["sync/probe_max_abs"] < 1e-4
        assert row["mismatch/max_abs_diff"] < 1e-3  # engine vs trainer on every sampled token
        assert all(math.isfinite(v) for v in row.values())
    return rows


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tp=2"],
        ["parallel.pp=2", "parallel.vpp=2", "actor.ppo_mini_batch_size=2", "algorithm.off_policy_loss=tis"],
    ],
    ids=["tp2pp1", "tp1pp2vpp2-old-logprobs-and-is-weights-from-update"],
)
def test_rl_step_on_model_parallel_layouts(tmp_path, layout):
    rows = _session(tmp_path, layout, ["grpo", "grpo"])
    assert rows[-1]["sync/weight_version"] == 3  # initial sync + one per step
    # Two mini-batches recompute the old log-probs first; one takes them from the update.
    recomputed = "actor.ppo_mini_batch_size=2" not in layout
    assert all(("timing_s/old_log_prob" in r) == recomputed for r in rows)
    if not recomputed:  # old log-probs are the update's own: the ratio is exactly 1
        assert all(r["actor/ppo_kl"] == 0.0 and r["actor/pg_clipfrac"] == 0.0 for r in rows)
        # The loss weighted the tokens by pi_old / pi_engine (on the last pipeline stage): the
        # engine computes the trainer's log-probs, so the weights are 1 within fp32 noise.
        assert all(abs(r["mismatch/is_weight_mean"] - 1.0) < 1e-3 for r in rows)


def test_every_estimator_runs_a_step_with_two_data_parallel_ranks(tmp_path):
    rows = _session(
        tmp_path,
        ["parallel.dp=2", "algorithm.kl_loss_coef=0.01", "algorithm.kl_reward_coef=0.01"],
        ESTIMATORS,
    )
    assert len(rows) == len(ESTIMATORS)
    assert all("actor/kl_loss" in r and "critic/kl_reward" in r for r in rows)
    assert all("timing_s/ref" in r and "critic/kl" in r for r in rows)  # the reference ran
