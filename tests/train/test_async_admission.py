"""Admission under the staleness bound (train/async_rollouts.py), on a stand-in for the trainer
that records what would be submitted to the engines: how many batches are ahead, in which
order, and the check that refuses a token older than the bound."""

import pytest
import torch

from megatron_agent.config import load_config, make_plan
from megatron_agent.data.sampler import PromptSampler
from megatron_agent.rl import staleness_metrics
from megatron_agent.train.async_rollouts import RolloutPipeline
from megatron_agent.train.batch import RLBatch


class Engines(list):
    """One engine that records the calls queued on it."""

    def __init__(self, calls):
        super().__init__([None])
        self.calls = calls

    def submit(self, method, ranks=None):
        self.calls.append(method)


class Recorder:
    """What the pipeline asks of the engines, in order (no engine runs)."""

    def __init__(self, eta: int):
        self.cfg = load_config(
            None, ["trainer.mode=async", f"async.max_staleness={eta}", "algorithm.off_policy_loss=decoupled"]
        )
        self.plan = make_plan(self.cfg)
        self.sampler = PromptSampler(16, seed=0, shuffle=True)
        self.train_tasks = list(range(16))
        self.calls: list = []
        self.engines = Engines(self.calls)

    def reseed_engines(self, seed, step, wait=True):
        assert not wait  # queued before the batch's generation, never waited for
        self.calls.append(("reseed", step))

    def submit_rollout(self, tasks, n, reseed=None):
        self.calls.append(("generate", tuple(tasks), n))


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_at_most_eta_plus_one_batches_are_ahead_of_the_trainer(eta):
    t = Recorder(eta)
    pipe = RolloutPipeline(t, eta)
    for updates in range(6):
        pipe.admit(updates_done=updates, last_step=6)
        ahead = pipe.admitted - updates
        assert ahead == min(eta + 1, 6 - updates)  # as many as the bound allows, never more
        pipe.batches.popleft()  # the step takes its batch
    steps = [c[1] for c in t.calls if isinstance(c, tuple) and c[0] == "reseed"]
    assert steps == [1, 2, 3, 4, 5, 6]  # each batch once, in step order


def test_the_prompts_are_the_samplers_order_whatever_the_bound():
    orders = []
    for eta in (0, 2):
        t = Recorder(eta)
        pipe = RolloutPipeline(t, eta)
        for updates in range(4):
            pipe.admit(updates, last_step=4)
        orders.append([c[1] for c in t.calls if isinstance(c, tuple) and c[0] == "generate"])
    assert orders[0] == orders[1] and len(orders[0]) == 4


def _batch(versions: list[list[int]]) -> RLBatch:
    rows = [torch.tensor(v, dtype=torch.float32) for v in versions]
    batch = RLBatch(
        uids=["a", "b"],
        group_ids=["g", "g"],
        sequences=[[0] * (len(v) + 1) for v in versions],
        rewards=torch.zeros(2),
    )
    batch.tensors = {
        "policy_version": rows,
        "loss_mask": [(r >= 0).float() for r in rows],
        "old_logp": [torch.zeros_like(r) for r in rows],
        "rollout_logp": [torch.full_like(r, -0.5) for r in rows],
    }
    return batch


def stale(batch: RLBatch, trainer_version: int) -> dict:
    names = ("policy_version", "old_logp", "rollout_logp", "loss_mask")
    return staleness_metrics(
        *(batch.padded(k) for k in names), trainer_version=trainer_version, max_staleness=1
    )


def test_staleness_is_read_per_token_and_a_token_past_the_bound_is_refused():
    batch = _batch([[-1, 3, 3, 4], [-1, 4, 4, -1]])  # -1: not sampled (prompt, tool, template)
    m = stale(batch, trainer_version=4)
    assert m["async/staleness/max"] == 1 and m["async/staleness/mean"] == pytest.approx(2 / 5)
    assert m["mismatch/staleness_1/abs_diff_mean"] == pytest.approx(0.5)
    with pytest.raises(RuntimeError, match="2 versions stale .async.max_staleness=1"):
        stale(batch, trainer_version=5)
