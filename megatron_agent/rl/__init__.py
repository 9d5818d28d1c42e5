"""RL core: advantage estimators, KL estimators and controllers, the fp32 masked policy loss,
loss aggregation, rollout-vs-trainer mismatch, and the step guard. Pure torch."""

from megatron_agent.rl.advantages import ESTIMATORS, compute_advantages
from megatron_agent.rl.aggregate import AGG_MODES, BatchCounts, agg_loss, global_batch_counts
from megatron_agent.rl.guard import (
    GuardBatch,
    GuardDecision,
    GuardError,
    GuardLimits,
    StepGuard,
    agree_to_skip,
    format_report_table,
)
from megatron_agent.rl.kl import KL_ESTIMATORS, apply_kl_in_reward, compute_kl_loss, kl_penalty
from megatron_agent.rl.kl_controller import AdaptiveKLController, FixedKLController, make_kl_controller
from megatron_agent.rl.mismatch import mismatch_metrics, rollout_is_weights, staleness_metrics
from megatron_agent.rl.policy_loss import LOSS_MODES, compute_policy_loss, token_policy_loss

__all__ = [
    "AGG_MODES",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_MODES",
    "AdaptiveKLController",
    "BatchCounts",
    "FixedKLController",
    "GuardBatch",
    "GuardDecision",
    "GuardError",
    "GuardLimits",
    "StepGuard",
    "agg_loss",
    "agree_to_skip",
    "apply_kl_in_reward",
    "compute_advantages",
    "compute_kl_loss",
    "compute_policy_loss",
    "format_report_table",
    "global_batch_counts",
    "kl_penalty",
    "make_kl_controller",
    "mismatch_metrics",
    "rollout_is_weights",
    "staleness_metrics",
    "token_policy_loss",
]
