"""RL core: advantage estimators, KL estimators and controllers, the fp32 masked policy loss,
loss aggregation, rollout-vs-trainer mismatch, and the step guard. Pure torch.

The names below are imported from their modules on first use (`megatron_agent/lazy_exports.py`): the
driver makes its KL controller (`rl.kl_controller`) before its workers start, without torch."""

from __future__ import annotations

from megatron_agent.lazy_exports import lazy_exports

_MODULE_OF = {
    "ESTIMATORS": "advantages",
    "compute_advantages": "advantages",
    "AGG_MODES": "aggregate",
    "BatchCounts": "aggregate",
    "agg_loss": "aggregate",
    "global_batch_counts": "aggregate",
    "GuardBatch": "guard",
    "GuardDecision": "guard",
    "GuardError": "guard",
    "GuardLimits": "guard",
    "StepGuard": "guard",
    "agree_to_skip": "guard",
    "format_report_table": "guard",
    "KL_ESTIMATORS": "kl",
    "apply_kl_in_reward": "kl",
    "compute_kl_loss": "kl",
    "kl_penalty": "kl",
    "AdaptiveKLController": "kl_controller",
    "FixedKLController": "kl_controller",
    "make_kl_controller": "kl_controller",
    "mismatch_metrics": "mismatch",
    "rollout_is_weights": "mismatch",
    "staleness_metrics": "mismatch",
    "LOSS_MODES": "policy_loss",
    "compute_policy_loss": "policy_loss",
    "token_policy_loss": "policy_loss",
}

__all__ = sorted(_MODULE_OF)

__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)
