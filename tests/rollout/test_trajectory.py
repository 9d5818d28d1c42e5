"""Trajectory bookkeeping, the padded training batch and the rollout dump (no engine needed)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_agent.rollout.dump import DUMP_FIELDS, read_rollout_dump, rollout_dump_path, write_rollout_dump
from megatron_agent.rollout.trajectory import TokenSource, ToolCallRecord, Trajectory, build_training_batch

S, INJ, T, P = TokenSource.SAMPLED, TokenSource.INJECTED, TokenSource.TOOL, TokenSource.TEMPLATE


def _traj(uid="a/0") -> Trajectory:
    tr = Trajectory(uid=uid, prompt_ids=[1, 2, 3])
    tr.append([10, 11], S, [-0.5, -1.5])
    tr.append([99], INJ)
    tr.append([5, 6], P)
    tr.append([20], T)
    tr.append([7], P)
    tr.append([12, 99], S, [-0.25, -0.125])
    tr.tool_calls.append(ToolCallRecord("calculator", {"expression": "1+2"}, "ok"))
    tr.num_turns, tr.finish_reason, tr.reward = 2, "stop", 1.0
    return tr


def test_loss_mask_is_sampled_only():
    tr = _traj()
    assert tr.loss_mask == [1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert [lp is None for lp in tr.rollout_logprobs] == [not m for m in tr.loss_mask]


def test_training_batch_shapes_padding_and_alignment():
    a, b = _traj("a/0"), Trajectory(uid="b/0", prompt_ids=[4])
    b.append([30], S, [-2.0])
    batch = build_training_batch([a, b], pad_id=0)
    assert batch["input_ids_BT"].shape == (2, 12)
    assert batch["input_ids_BT"][0].tolist() == [1, 2, 3, 10, 11, 99, 5, 6, 20, 7, 12, 99]
    assert batch["input_ids_BT"][1].tolist() == [4, 30] + [0] * 10
    assert batch["loss_mask_BT"][0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert batch["attention_mask_BT"][1].sum() == 2
    lp = batch["rollout_logprobs_BT"]
    assert lp[0, 3] == -0.5 and lp[0, 11] == -0.125 and lp[1, 1] == -2.0
    assert batch["prompt_lengths_B"].tolist() == [3, 1] and batch["response_lengths_B"].tolist() == [9, 1]
    assert batch["rewards_B"][0] == 1.0 and math.isnan(batch["rewards_B"][1])


def test_loss_token_without_logprob_raises():
    """The seed bug: a hand-appended token marked as sampled, with no engine log-prob."""
    row = _traj().to_dump()
    row["token_source"][2] = "sampled"  # the injected <|im_end|> leaking into the loss
    with pytest.raises(ValueError, match="token 2 .*no finite rollout logprob"):
        build_training_batch([Trajectory.from_dump(row)])
    row = _traj().to_dump()
    row["rollout_logprobs"][0] = float("nan")
    with pytest.raises(ValueError, match="token 0"):
        build_training_batch([Trajectory.from_dump(row)])


def test_append_guards_provenance():
    tr = Trajectory(uid="x", prompt_ids=[1])
    with pytest.raises(AssertionError):
        tr.append([5], S)
    with pytest.raises(AssertionError):
        tr.append([5], INJ, [-1.0])


def test_dump_contract(tmp_path):
    trajs = [_traj("a/0"), _traj("a/1")]
    extra = [{"old_logprobs": [0.0] * 9, "advantages": torch.ones(9)}, {}]
    path = write_rollout_dump(tmp_path, 7, trajs, extra)
    assert path == rollout_dump_path(tmp_path, 7) == tmp_path / "rollouts" / "step_000007.jsonl"
    rows = read_rollout_dump(path)
    assert len(rows) == 2 and all(tuple(r) == DUMP_FIELDS for r in rows)
    r0, r1 = rows
    assert r0["token_source"] == [
        "sampled",
        "sampled",
        "injected",
        "template",
        "template",
        "tool",
        "template",
        "sampled",
        "sampled",
    ]
    assert r0["rollout_logprobs"][2] is None and r0["advantages"] == [1.0] * 9 and r0["ref_logprobs"] is None
    assert r1["old_logprobs"] is None and r1["tool_calls"][0]["status"] == "ok"
    back = Trajectory.from_dump(r0)
    assert back.response_ids == trajs[0].response_ids and back.token_source == trajs[0].token_source
    with pytest.raises(ValueError, match="unknown rollout-dump field"):
        trajs[0].to_dump(oldlogprobs=[])
    assert json.loads(path.read_text().splitlines()[0])["uid"] == "a/0"


def test_every_sampled_token_carries_the_version_that_sampled_it_and_the_state_round_trips():
    from megatron_agent.rollout.trajectory import build_training_batch

    traj = Trajectory(uid="t/0", prompt_ids=[1, 2], weight_version=3, task_uid="t")
    traj.append([5, 6], S, [-0.1, -0.2], version=3)
    traj.append([7], T)
    traj.append([8], S, [-0.3], version=4)  # a sync between the turns
    traj.turn_spans = [(0, 2), (3, 4)]
    traj.reward, traj.reward_info = 1.0, {"numeric": 1.0}
    assert traj.token_versions == [3, 3, None, 4]
    assert traj.to_dump()["policy_versions"] == [3, 3, None, 4]
    back = Trajectory.from_state(json.loads(json.dumps(traj.to_state())))
    assert back == traj
    tb = build_training_batch([traj])
    assert tb["policy_versions_BT"].tolist() == [[-1, -1, 3, 3, -1, 4]]
