"""Admission under the staleness bound (train/async_rollouts.py), on a stand-in for the trainer
that records what would be submitted to the engines: how many batches are ahead, in which
order, where a deterministic run's syncs interrupt them, and the check that refuses a token
older than the bound."""

import pytest
import torch

from megatron_agent.config import load_config, make_plan
from megatron_agent.data.sampler import PromptSampler
from megatron_agent.rl import staleness_metrics
from megatron_agent.train.async_rollouts import RolloutPipeline
from megatron_agent.train.batch import RLBatch


class Engines(list):
    """Two engines that record the calls made on them."""

    def __init__(self, calls):
        super().__init__([None, None])
        self.calls = calls

    def call(self, method, *args, ranks=None):
        self.calls.append((method, *args, tuple(ranks)))


class Recorder:
    """What the pipeline asks of the engines, in order (no engine runs)."""

    def __init__(self, eta: int, *overrides: str):
        self.cfg = load_config(
            None,
            [
                "trainer.mode=async",
                f"async.max_staleness={eta}",
                "algorithm.off_policy_loss=decoupled",
                "trainer.total_steps=6",
                *overrides,
            ],
        )
        self.plan = make_plan(self.cfg)
        self.sampler = PromptSampler(16, seed=0, shuffle=True)
        self.train_tasks = list(range(16))
        self.calls: list = []
        self.engines = Engines(self.calls)
        self.replaced: set[int] = set()

    def submit_rollout(self, tasks, n, reseed=None, pause_after=None):
        self.calls.append(("generate", tuple(tasks), n, reseed[1], pause_after))


def _generated(t: Recorder) -> list[tuple]:
    return [c for c in t.calls if c[0] == "generate"]


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_at_most_eta_plus_one_batches_are_ahead_of_the_trainer(eta):
    t = Recorder(eta)
    pipe = RolloutPipeline(t, eta)
    for updates in range(6):
        pipe.admit(updates_done=updates, last_step=6)
        ahead = pipe.admitted - updates
        assert ahead == min(eta + 1, 6 - updates)  # as many as the bound allows, never more
        pipe.batches.popleft()  # the step takes its batch
    assert [c[3] for c in _generated(t)] == [1, 2, 3, 4, 5, 6]  # each batch once, with its seeds
    assert all(c[4] is None for c in _generated(t))  # not deterministic: syncs interrupt on arrival


def test_the_prompts_are_the_samplers_order_whatever_the_bound():
    orders = []
    for eta in (0, 2):
        t = Recorder(eta)
        pipe = RolloutPipeline(t, eta)
        for updates in range(4):
            pipe.admit(updates, last_step=4)
        orders.append([c[1] for c in _generated(t)])
    assert orders[0] == orders[1] and len(orders[0]) == 4


@pytest.mark.parametrize("eta", [1, 2])
def test_deterministic_syncs_interrupt_fixed_batches_at_a_fixed_engine_step(eta):
    # Sync u (after update u - 1) interrupts batch u - 1 + eta after 5 engine steps of its
    # rollout; batches 1..eta start before any update and no sync meets them; past the last
    # batch, a sync waits for the last rollout to end.
    t = Recorder(eta, "trainer.deterministic=true", "async.interrupt_after_engine_steps=5")
    pipe = RolloutPipeline(t, eta)
    for step in range(1, 7):
        pipe.admit(updates_done=step - 1, last_step=6)
        pipe.batches.popleft()
        pipe.sync_points(step)
    pauses = {c[3]: c[4] for c in _generated(t)}
    assert pauses == {b: (5 if b > eta else None) for b in range(1, 7)}
    points = [c[1:] for c in t.calls if c[0] == "sync_point"]
    ranks = (0, 1)  # data.train_batch_size=2 prompts: one share on each engine
    want = [(s + eta, True, ranks) if s + eta <= 6 else (6, False, ranks) for s in range(1, 7)]
    assert points == want
    t.replaced.add(0)  # a replaced engine takes syncs as they come (no fixed point to wait for)
    pipe.sync_points(6)
    assert t.calls[-1] == ("sync_point", 6, False, (1,))


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
