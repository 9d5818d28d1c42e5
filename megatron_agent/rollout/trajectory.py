"""Trajectories with token provenance, and the padded training tensors built from them.

Every response token carries a source (`TokenSource`): `sampled` by the rollout engine (with its
log-prob), `injected` by our code (a closing end-of-turn token after a stop at `</tool_call>`),
`tool` (tool output) or `template` (chat-template tokens around turns). Only `sampled` tokens
carry loss: `loss_mask = source == sampled`. `build_training_batch` refuses to build a batch in
which a loss-bearing token has no rollout log-prob.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch


class TokenSource(StrEnum):
    """Where a response token came from (the provenance contract in DESIGN.md)."""

    SAMPLED = "sampled"
    INJECTED = "injected"
    TOOL = "tool"
    TEMPLATE = "template"


@dataclass
class ToolCallRecord:
    """One tool call made in a trajectory."""

    name: str
    """Tool name as the model wrote it ('' when the call could not be parsed)."""
    arguments: Any
    """Parsed arguments (a dict), or the raw text when parsing failed."""
    status: str
    """ok, malformed, unknown_tool, bad_arguments, error, timeout, truncated, invalid_utf8."""
    turn: int = 0
    """Assistant turn (0-based) in which the call was made."""
    seconds: float = 0.0
    """Wall time the tool took."""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"name": self.name, "arguments": self.arguments, "status": self.status, "turn": self.turn}


@dataclass
class Trajectory:
    """One sampled multi-turn trajectory: prompt ids, response ids and per-token provenance."""

    uid: str
    """Unique id: '<task uid>/<sample index>'."""
    prompt_ids: list[int]
    """Prompt token ids (the rendered chat prompt, ending with the generation prompt)."""
    response_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: sampled, injected, tool and template tokens."""
    token_source: list[TokenSource] = field(default_factory=list)
    """Source of each response token."""
    rollout_logprobs: list[float | None] = field(default_factory=list)
    """Engine log-prob of each sampled token; None for the other sources."""
    num_turns: int = 0
    """Assistant turns generated."""
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    """Tool calls in order."""
    finish_reason: str = ""
    """stop (answered), length (turn cut by max tokens), max_turns, max_tokens, timeout, error."""
    weight_version: int = 0
    """Engine weight version that generated the sampled tokens (the lowest, if it changed)."""
    reward: float | None = None
    """Scalar reward, filled by the reward function."""
    reward_info: dict = field(default_factory=dict)
    """Reward components (e.g. {'f1': 0.5, 'format': 1.0})."""
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    """(start, end) offsets into response_ids of each turn's sampled tokens."""
    task_uid: str = ""
    """Uid of the task the trajectory answers."""
    sample_index: int = 0
    """Index of this sample within its group (the GRPO group is the task)."""
    token_versions: list[int | None] = field(default_factory=list)
    """Policy version of each response token: the engine weight version that sampled it; None for
    the other sources. A trajectory can span versions (a sync between its turns)."""

    def append(
        self,
        ids: list[int],
        source: TokenSource,
        logprobs: list[float] | None = None,
        version: int | list[int] | None = None,
    ) -> None:
        """Append `ids` with one source; `logprobs` is required for, and only for, sampled ids,
        and `version` (the sampling weight version, default `weight_version`; or one per id, when
        a weight sync split the request) only applies to them."""
        if source is TokenSource.SAMPLED:
            assert logprobs is not None and len(logprobs) == len(ids), "sampled ids need one logprob each"
            self.rollout_logprobs.extend(float(x) for x in logprobs)
            if isinstance(version, list):
                assert len(version) == len(ids), "sampled ids need one version each"
                self.token_versions.extend(int(v) for v in version)
            else:
                self.token_versions.extend(
                    [self.weight_version if version is None else int(version)] * len(ids)
                )
        else:
            assert logprobs is None, f"{source.value} tokens carry no rollout logprob"
            self.rollout_logprobs.extend([None] * len(ids))
            self.token_versions.extend([None] * len(ids))
        self.response_ids.extend(int(t) for t in ids)
        self.token_source.extend([source] * len(ids))

    @property
    def loss_mask(self) -> list[int]:
        """1 where the token was sampled by the engine, else 0."""
        return [int(s is TokenSource.SAMPLED) for s in self.token_source]

    @property
    def all_ids(self) -> list[int]:
        """Prompt followed by response ids."""
        return self.prompt_ids + self.response_ids

    def num_tokens(self, source: TokenSource | None = None) -> int:
        """Response tokens of `source` (all response tokens when None)."""
        if source is None:
            return len(self.response_ids)
        return sum(s is source for s in self.token_source)

    def to_dump(self, **extra: Any) -> dict:
        """The rollout-dump JSON object (DESIGN.md); `extra` fills old/ref logprobs, advantages
        and the critic's values (a gae run)."""
        row = {
            "uid": self.uid,
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "token_source": [s.value for s in self.token_source],
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "old_logprobs": None,
            "ref_logprobs": None,
            "advantages": None,
            "values": None,
            "reward": self.reward,
            "num_turns": self.num_turns,
            "tool_calls": [c.to_dict() for c in self.tool_calls],
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
            "policy_versions": self.token_versions,
        }
        for key, value in extra.items():
            if key not in row:
                raise ValueError(f"unknown rollout-dump field {key!r}; known: {sorted(row)}")
            row[key] = value.tolist() if isinstance(value, torch.Tensor) else value
        return row

    @classmethod
    def from_dump(cls, row: dict) -> Trajectory:
        """Rebuild a trajectory from its rollout-dump object (tool calls as records)."""
        return cls(
            uid=row["uid"],
            prompt_ids=list(row["prompt_ids"]),
            response_ids=list(row["response_ids"]),
            token_source=[TokenSource(s) for s in row["token_source"]],
            rollout_logprobs=list(row["rollout_logprobs"]),
            num_turns=row.get("num_turns", 0),
            tool_calls=[
                ToolCallRecord(c["name"], c["arguments"], c["status"], c.get("turn", 0))
                for c in row.get("tool_calls", [])
            ],
            finish_reason=row.get("finish_reason", ""),
            weight_version=row.get("weight_version", 0),
            reward=row.get("reward"),
            token_versions=list(row.get("policy_versions") or [None] * len(row["response_ids"])),
        )

    def to_state(self) -> dict:
        """Every field as JSON values (an async run's checkpoint keeps its generated, untrained groups)."""
        row = dataclasses.asdict(self)
        row["token_source"] = [s.value for s in self.token_source]
        return row

    @classmethod
    def from_state(cls, row: dict) -> Trajectory:
        """The trajectory `to_state` wrote."""
        fields = dict(row)
        fields["token_source"] = [TokenSource(s) for s in row["token_source"]]
        fields["tool_calls"] = [ToolCallRecord(**c) for c in row["tool_calls"]]
        fields["turn_spans"] = [tuple(span) for span in row["turn_spans"]]
        return cls(**fields)


def build_training_batch(trajectories: list[Trajectory], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded training tensors over prompt + response for `trajectories`.

    Returns (B = trajectories, T = longest prompt + response):
      input_ids_BT (int64, padded with `pad_id`), attention_mask_BT (int64),
      loss_mask_BT (float32; 1 on sampled response tokens), rollout_logprobs_BT (float32, 0 where
      not loss-bearing), policy_versions_BT (int64, the sampling weight version; -1 where not
      loss-bearing), prompt_lengths_B, response_lengths_B, rewards_B (float32, NaN if unset).
    `loss_mask_BT[b, t]` refers to the token `input_ids_BT[b, t]` (predicted from position t - 1).
    Raises ValueError naming the trajectory and position if a loss-bearing token has no finite
    rollout log-prob (an injected token leaking into the loss is exactly the bug this prevents).
    """
    if not trajectories:
        raise ValueError("build_training_batch needs at least one trajectory")
    num_rows = len(trajectories)
    max_len = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    input_ids_BT = torch.full((num_rows, max_len), pad_id, dtype=torch.int64)
    attention_mask_BT = torch.zeros((num_rows, max_len), dtype=torch.int64)
    loss_mask_BT = torch.zeros((num_rows, max_len), dtype=torch.float32)
    rollout_logprobs_BT = torch.zeros((num_rows, max_len), dtype=torch.float32)
    policy_versions_BT = torch.full((num_rows, max_len), -1, dtype=torch.int64)
    prompt_lengths_B = torch.zeros(num_rows, dtype=torch.int64)
    response_lengths_B = torch.zeros(num_rows, dtype=torch.int64)
    rewards_B = torch.full((num_rows,), float("nan"), dtype=torch.float32)
    for b, traj in enumerate(trajectories):
        if not (len(traj.response_ids) == len(traj.token_source) == len(traj.rollout_logprobs)):
            raise ValueError(
                f"trajectory {traj.uid}: response_ids ({len(traj.response_ids)}), token_source "
                f"({len(traj.token_source)}) and rollout_logprobs ({len(traj.rollout_logprobs)}) differ in length"
            )
        num_prompt = len(traj.prompt_ids)
        ids = traj.prompt_ids + traj.response_ids
        input_ids_BT[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        attention_mask_BT[b, : len(ids)] = 1
        versions = traj.token_versions or [traj.weight_version] * len(traj.response_ids)
        for i, (source, logp) in enumerate(zip(traj.token_source, traj.rollout_logprobs)):
            if source is not TokenSource.SAMPLED:
                continue
            if logp is None or not math.isfinite(logp):
                raise ValueError(
                    f"trajectory {traj.uid}: loss-bearing response token {i} (id {traj.response_ids[i]}) "
                    f"has no finite rollout logprob ({logp!r}); only engine-sampled tokens may carry loss"
                )
            loss_mask_BT[b, num_prompt + i] = 1.0
            rollout_logprobs_BT[b, num_prompt + i] = logp
            policy_versions_BT[b, num_prompt + i] = versions[i]
        prompt_lengths_B[b] = num_prompt
        response_lengths_B[b] = len(traj.response_ids)
        if traj.reward is not None:
            rewards_B[b] = float(traj.reward)
    return {
        "input_ids_BT": input_ids_BT,
        "attention_mask_BT": attention_mask_BT,
        "loss_mask_BT": loss_mask_BT,
        "rollout_logprobs_BT": rollout_logprobs_BT,
        "policy_versions_BT": policy_versions_BT,
        "prompt_lengths_B": prompt_lengths_B,
        "response_lengths_B": response_lengths_B,
        "rewards_B": rewards_B,
    }
