"""Dynamic sampling (DAPO): groups whose rewards all tie are dropped and the batch is refilled."""

import pytest

from megatron_agent.config import load_config
from megatron_agent.data.sampler import PromptSampler
from megatron_agent.data.tasks import Task
from megatron_agent.rollout.trajectory import Trajectory
from megatron_agent.train.rl_loop import collect_rollouts


class ScriptedRollouts:
    """The driver-side surface `collect_rollouts` uses, with rewards decided per task uid."""

    def __init__(self, cfg, rewards_of):
        self.cfg = cfg
        self.train_tasks = [
            Task(uid=f"t{i}", messages=[{"role": "user", "content": str(i)}]) for i in range(8)
        ]
        self.sampler = PromptSampler(len(self.train_tasks), seed=0, shuffle=False)
        self.rewards_of = rewards_of
        self.calls = []

    def rollout(self, tasks, n, greedy=False):
        self.calls.append([t.uid for t in tasks])
        out = []
        for task in tasks:
            for k in range(n):
                tr = Trajectory(uid=f"{task.uid}/{k}", prompt_ids=[1, 2], task_uid=task.uid, sample_index=k)
                tr.reward = self.rewards_of(task.uid, k)
                out.append(tr)
        return out


def _cfg(**kw):
    over = [f"{k}={v}" for k, v in {"data.train_batch_size": 4, "rollout.n": 2, **kw}.items()]
    return load_config(None, over)


def test_tied_groups_are_dropped_and_refilled():
    # Even tasks tie (both samples 0), odd tasks differ: 4 groups need several rounds.
    t = ScriptedRollouts(
        _cfg(**{"algorithm.dynamic_sampling": "true"}), lambda uid, k: k * (int(uid[1:]) % 2)
    )
    metrics = {}
    r = collect_rollouts(t, metrics)
    trajectories, group_ids, tasks = r.trajectories, r.group_ids, r.group_tasks
    # Each round draws only as many prompts as groups are still missing.
    assert t.calls == [["t0", "t1", "t2", "t3"], ["t4", "t5"], ["t6"], ["t7"]]
    assert [tr.task_uid for tr in trajectories] == ["t1", "t1", "t3", "t3", "t5", "t5", "t7", "t7"]
    assert len(set(group_ids)) == 4 and set(tasks) == set(group_ids)
    assert metrics["rollout/gen_batches"] == 4 and metrics["rollout/dropped_groups"] == 4


def test_without_dynamic_sampling_ties_are_kept():
    t = ScriptedRollouts(_cfg(), lambda uid, k: 0.0)
    r = collect_rollouts(t, {})
    trajectories = r.trajectories
    assert len(trajectories) == 8 and len(t.calls) == 1


def test_every_group_tied_is_a_clear_error():
    t = ScriptedRollouts(
        _cfg(**{"algorithm.dynamic_sampling": "true", "algorithm.max_num_gen_batches": 2}), lambda uid, k: 1.0
    )
    with pytest.raises(RuntimeError, match="dynamic sampling kept no group in 2 generation rounds"):
        collect_rollouts(t, {})
    assert len(t.calls) == 2
