"""Reward functions on worked examples."""

from __future__ import annotations

import pytest

from megatron_agent.envs.rewards import (
    compute_reward,
    exact_match,
    extract_answer,
    f1,
    f1_score,
    format_reward,
    normalize_answer,
    numeric,
    reward_weights,
)
from megatron_agent.rollout.trajectory import ToolCallRecord, Trajectory


def test_normalize_and_extract():
    assert normalize_answer("  The Eiffel   Tower! ") == "eiffel tower"
    assert extract_answer("think <answer>a</answer> more <answer> b </answer>") == "b"
    assert extract_answer("no tags") is None


def test_exact_match_and_f1_hotpot_style():
    assert exact_match("<answer>the Eiffel tower.</answer>", "Eiffel Tower") == 1.0
    assert exact_match("<answer>Eiffel</answer>", ["Tour Eiffel", "Eiffel"]) == 1.0
    assert exact_match("Eiffel Tower", "Eiffel Tower") == 0.0  # no answer tags
    # prediction "elra voss senior" vs gold "elra voss": precision 2/3, recall 1 -> F1 0.8
    assert f1("<answer>Elra Voss senior</answer>", "Elra Voss") == pytest.approx(0.8)
    assert f1_score("a b", "c d") == 0.0 and f1_score("", "x") == 0.0


def test_numeric_match():
    assert numeric("<answer>19</answer>", "19") == 1.0
    assert numeric("<answer>The result is 1,024.0</answer>", 1024) == 1.0
    assert numeric("<answer>-3.5</answer>", "-3.5") == 1.0
    assert numeric("<answer>20</answer>", "19") == 0.0
    assert numeric("<answer>none</answer>", "19") == 0.0


def test_format_reward_and_weighted_sum():
    traj = Trajectory(uid="u", prompt_ids=[1])
    assert format_reward("<answer>3</answer>", None, traj) == 1.0
    assert format_reward("3", None, traj) == -1.0
    traj.tool_calls.append(ToolCallRecord("", "{", "malformed"))
    assert format_reward("<answer>3</answer>", None, traj) == -1.0
    spec = {"fns": {"numeric": 1.0, "format": 0.1}, "ground_truth": "3"}
    total, parts = compute_reward(spec, "<answer>3</answer>", Trajectory(uid="v", prompt_ids=[1]))
    assert total == pytest.approx(1.1) and parts == {"numeric": 1.0, "format": 1.0}
    total, _ = compute_reward({"fn": "tests.envs.test_rewards.half", "ground_truth": None}, "x")
    assert total == 0.5
    with pytest.raises(ValueError, match="needs 'fn'"):
        reward_weights({"ground_truth": 1})
    with pytest.raises(ValueError, match="unknown reward"):
        compute_reward({"fn": "exactmatch"}, "x")


def half(response, ground_truth, trajectory):
    return 0.5
