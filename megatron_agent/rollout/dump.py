"""The rollout dump: one JSON object per trajectory in `<run_dir>/rollouts/step_{N:06d}.jsonl`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_agent.rollout.trajectory import Trajectory

DUMP_FIELDS = (
    "uid",
    "prompt_ids",
    "response_ids",
    "token_source",
    "loss_mask",
    "rollout_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "advantages",
    "values",
    "reward",
    "num_turns",
    "tool_calls",
    "finish_reason",
    "weight_version",
    "policy_versions",
)
"""Keys of every dump object, in order (DESIGN.md). old/ref logprobs, advantages and values (the
critic's, in a gae run) may be null."""


def rollout_dump_path(run_dir: str | os.PathLike, step: int) -> Path:
    """`<run_dir>/rollouts/step_{step:06d}.jsonl`."""
    return Path(run_dir) / "rollouts" / f"step_{step:06d}.jsonl"


def write_rollout_dump(
    run_dir: str | os.PathLike,
    step: int,
    trajectories: Sequence[Trajectory],
    per_trajectory: Sequence[dict[str, Any]] | None = None,
) -> Path:
    """Write the dump for `step` atomically (tmp file, then rename) and return its path.

    `per_trajectory[i]` optionally fills `old_logprobs`, `ref_logprobs` and `advantages` (lists or
    1-D tensors over the response tokens) for trajectory i; missing fields are written as null.
    """
    if per_trajectory is not None and len(per_trajectory) != len(trajectories):
        raise ValueError(
            f"per_trajectory has {len(per_trajectory)} entries for {len(trajectories)} trajectories"
        )
    path = rollout_dump_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for i, traj in enumerate(trajectories):
            extra = per_trajectory[i] if per_trajectory is not None else {}
            f.write(json.dumps(_json_safe(traj.to_dump(**extra)), allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def _json_safe(value: Any) -> Any:
    """`value` with non-finite floats as the strings 'nan', 'inf', '-inf' (a step the guard
    skipped for NaN log-probs is still dumped, and the dump stays strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def read_rollout_dump(path: str | os.PathLike) -> list[dict]:
    """Read a dump file back as a list of dicts."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
