"""`async.share_cores` on the real stack: an async run that is not deterministic, one Megatron rank
and one vLLM engine on this machine's cores. The rank follows the engine's activity byte
(platform/core_sharing.py): it ran part of its layer passes on half its threads, while the engine
generated the next batch beside its update, and the run's syncs stay verified."""

import pytest

from megatron_agent.train.megatron_worker import rank_threads
from tests.conftest import metrics_by_step, train_quickstart

pytestmark = pytest.mark.skipif(rank_threads(1) < 2, reason="a rank with one thread has none to give up")


def test_the_rank_computes_on_half_its_threads_while_the_engine_generates(tmp_path):
    run_dir = tmp_path / "run"
    train_quickstart(
        run_dir,
        "sft.steps=0",
        "trainer.total_steps=3",
        "trainer.test_freq=0",
        "data.num_synthetic_val_tasks=4",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "trainer.mode=async",
        "async.max_staleness=1",
        "algorithm.off_policy_loss=decoupled",
        "checkpoint.save_freq=0",
    )
    metrics = metrics_by_step(run_dir)
    shares = [metrics[step]["async/rank_threads_low_share"] for step in (1, 2, 3)]
    assert all(0.0 <= s <= 1.0 for s in shares), shares
    # batch k + 1 generates while update k runs (steps 1 and 2); nothing is left to generate at step 3
    assert max(shares[:2]) > 0.0, shares
    assert all(metrics[step]["sync/verified"] == 1.0 for step in (1, 2, 3))
