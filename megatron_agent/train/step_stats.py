"""The statistics of one RL step over its batch (the metrics stage of rl_loop.py): the
rollout-vs-trainer mismatch, advantages, returns, entropy and KL, the critic's values, and the
per-token fields of the rollout dump. All over the loss tokens, from [B, T] views of the batch."""

from __future__ import annotations

import torch

from megatron_agent.config import AlgorithmConfig
from megatron_agent.rl import mismatch_metrics
from megatron_agent.rl.value_loss import explained_variance
from megatron_agent.train.batch import RLBatch


def mismatch(batch: RLBatch, mask_BT, algorithm: AlgorithmConfig) -> dict[str, float]:
    """Rollout-vs-trainer mismatch metrics: engine vs old log-probs on the loss tokens."""
    mm = mismatch_metrics(
        batch.padded("rollout_logp"),
        batch.padded("old_logp"),
        mask_BT,
        thresholds=algorithm.mismatch_thresholds,
    )
    return {f"mismatch/{k}": float(v) for k, v in mm.items()}


def batch_stats(batch: RLBatch, mask_BT, adv_BT, returns_BT) -> dict[str, float]:
    """critic/* and actor/entropy statistics over the loss tokens (critic/kl when a reference ran)."""
    mask = mask_BT.bool()
    num = mask.sum().clamp(min=1)
    adv = adv_BT[mask]
    entropy_BT = batch.padded("entropy")
    stats = {
        "critic/rewards/mean": float(batch.rewards.mean()),
        "critic/advantages/mean": float(adv.mean()) if adv.numel() else 0.0,
        "critic/advantages/max": float(adv.max()) if adv.numel() else 0.0,
        "critic/advantages/min": float(adv.min()) if adv.numel() else 0.0,
        "critic/returns/mean": float(returns_BT[mask].mean()) if adv.numel() else 0.0,
        "actor/entropy": float(torch.where(mask, entropy_BT, 0.0).sum() / num),
    }
    if "ref_logp" in batch.tensors:
        kl_BT = batch.padded("old_logp") - batch.padded("ref_logp")
        stats["critic/kl"] = float(torch.where(mask, kl_BT, 0.0).sum() / num)
    return stats


def critic_stats(batch: RLBatch, mask_BT, returns_BT) -> dict[str, float]:
    """The critic's values before the update against the step's returns, over the loss tokens of
    the whole batch: `critic/values/mean` and `critic/vf_explained_var`."""
    mask = mask_BT.bool()
    values, returns = batch.padded("values")[mask], returns_BT[mask]
    return {
        "critic/values/mean": float(values.mean()) if values.numel() else 0.0,
        "critic/vf_explained_var": explained_variance(values, returns),
    }


def dump_fields(batch: RLBatch, trajectories: list) -> list[dict]:
    """Per-trajectory old/ref log-probs and advantages over the response tokens (for the dump)."""
    rows = []
    for b, traj in enumerate(trajectories):
        start = len(traj.prompt_ids) - 1  # target index of the first response token
        rows.append(
            {
                k: batch.tensors[name][b][start:].tolist()
                for k, name in (
                    ("old_logprobs", "old_logp"),
                    ("ref_logprobs", "ref_logp"),
                    ("advantages", "advantages"),
                    ("values", "values"),
                )
                if name in batch.tensors  # ref_logprobs stays null when no reference ran
            }
        )
    return rows
