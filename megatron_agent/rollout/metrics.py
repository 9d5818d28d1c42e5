"""Rollout metrics with the project's metric names (DESIGN.md)."""

from __future__ import annotations

from collections import Counter

from megatron_agent.rollout.trajectory import TokenSource, Trajectory

TOOL_ERROR_STATUSES = ("malformed", "unknown_tool", "bad_arguments", "error", "timeout", "invalid_utf8")
"""Call statuses counted in `tool/errors` (timeouts also in `tool/timeouts`)."""


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Reward, length, turn and tool statistics of a batch of trajectories.

    Keys: critic/score/mean|max|min, response_length/mean|max|clip_ratio (share ended by a token
    budget), turns/mean, num_turns/mean|max|min, tool/calls, tool/errors, tool/timeouts, tool/truncated,
    tool/status/<status>, tokens/<source>, finish/<reason>, rollout/num_trajectories.
    """
    num = len(trajectories)
    metrics: dict[str, float] = {"rollout/num_trajectories": float(num)}
    if num == 0:
        return metrics
    rewards = [t.reward for t in trajectories if t.reward is not None]
    if rewards:
        metrics["critic/score/mean"] = sum(rewards) / len(rewards)
        metrics["critic/score/max"] = max(rewards)
        metrics["critic/score/min"] = min(rewards)
    lengths = [len(t.response_ids) for t in trajectories]
    metrics["response_length/mean"] = sum(lengths) / num
    metrics["response_length/max"] = float(max(lengths))
    clipped = sum(t.finish_reason in ("length", "max_tokens") for t in trajectories)
    metrics["response_length/clip_ratio"] = clipped / num
    turns = [t.num_turns for t in trajectories]
    metrics["turns/mean"] = sum(turns) / num
    metrics["num_turns/mean"] = sum(turns) / num
    metrics["num_turns/max"] = float(max(turns))
    metrics["num_turns/min"] = float(min(turns))
    statuses = Counter(c.status for t in trajectories for c in t.tool_calls if c.status != "not_run")
    metrics["tool/calls"] = float(sum(statuses.values()))
    metrics["tool/errors"] = float(sum(statuses[s] for s in TOOL_ERROR_STATUSES))
    metrics["tool/timeouts"] = float(statuses["timeout"])
    metrics["tool/truncated"] = float(statuses["truncated"])
    for status, count in sorted(statuses.items()):
        metrics[f"tool/status/{status}"] = float(count)
    for source in TokenSource:
        metrics[f"tokens/{source.value}"] = float(sum(t.num_tokens(source) for t in trajectories))
    for reason, count in sorted(Counter(t.finish_reason for t in trajectories).items()):
        metrics[f"finish/{reason}"] = float(count)
    return metrics
