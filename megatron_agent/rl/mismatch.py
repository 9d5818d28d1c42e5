"""Rollout-vs-trainer mismatch: per-token comparison and truncated importance-sampling weights.

The rollout engine samples with its own kernels and precision (and possibly a stale weight
version), so its log-probs of the sampled tokens differ from the trainer's `old_logprob` of the
same tokens. `mismatch_metrics` summarises the per-token difference (log these under
`mismatch/`); `rollout_is_weights` turns it into truncated importance weights
pi_old / pi_rollout to pass to `compute_policy_loss(rollout_is_weights=...)`.
All computation is in fp32 with masked positions removed before any exp.
"""

from __future__ import annotations

import torch

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
_EXP_CLAMP = 20.0


def _masked_diff(rollout_logprob, old_logprob, mask):
    return torch.where(mask, old_logprob.detach().float() - rollout_logprob.detach().float(), 0.0)


def threshold_key(threshold: float) -> str:
    """Metric name of the share of tokens with |diff| above `threshold`, e.g. `frac_abs_diff_gt_0.5`."""
    return f"frac_abs_diff_gt_{threshold:g}"


@torch.no_grad()
def mismatch_metrics(
    rollout_logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    thresholds: tuple[float, ...] | list[float] = (0.1, 1.0),
) -> dict[str, torch.Tensor]:
    """Per-token |old_logprob - rollout_logprob| statistics over loss tokens (detached scalars).

    Keys: `mean_abs_diff`, `max_abs_diff`, `mean_diff` (signed: old - rollout, a bias),
    `mean_exp_abs_diff` (mean of exp(|diff|), the mean worst-case ratio), `num_tokens`, and
    `frac_abs_diff_gt_{t}` for each threshold t. A non-finite rollout or old log-prob on a loss
    token makes the statistics non-finite on purpose: that token should not be trained on.
    """
    mask = loss_mask.bool()
    diff = _masked_diff(rollout_logprob, old_logprob, mask)
    abs_diff = diff.abs()
    num = mask.sum().clamp(min=1)
    metrics = {
        "mean_abs_diff": abs_diff.sum() / num,
        "max_abs_diff": abs_diff.max() if abs_diff.numel() else abs_diff.new_zeros(()),
        "mean_diff": diff.sum() / num,
        "mean_exp_abs_diff": torch.where(mask, torch.exp(abs_diff.clamp(max=_EXP_CLAMP)), 0.0).sum() / num,
        "num_tokens": mask.sum().float(),
    }
    for t in thresholds:
        metrics[threshold_key(t)] = ((abs_diff > t) & mask).sum() / num
    return metrics


@torch.no_grad()
def rollout_is_weights(
    rollout_logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
    mode: str = "truncate",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights w = pi_old / pi_rollout [B, T] (fp32, detached, 0 when masked).

    `level="token"`: one weight per token, exp(old - rollout). `level="sequence"`: the product
    over the sequence's loss tokens, exp(sum of old - rollout), broadcast to its tokens.
    `mode="truncate"` caps weights at `cap` (TIS); `mode="mask"` sets weights above `cap` to 0
    (the token or sequence is dropped). Returns (weights, metrics) with `is_weight_mean`,
    `is_weight_max` (before the cap) and `is_capped_frac` over loss tokens.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout IS level {level!r}; expected one of {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown rollout IS mode {mode!r}; expected one of {', '.join(IS_MODES)}")
    if cap <= 0:
        raise ValueError(f"rollout IS cap must be positive, got {cap}")
    mask = loss_mask.bool()
    log_w = _masked_diff(rollout_logprob, old_logprob, mask)
    if level == "sequence":
        log_w = torch.where(mask, log_w.sum(dim=-1, keepdim=True).expand_as(log_w), 0.0)
    raw = torch.exp(log_w.clamp(-_EXP_CLAMP, _EXP_CLAMP))
    over = (raw > cap) & mask
    weights = raw.clamp(max=cap) if mode == "truncate" else torch.where(over, 0.0, raw)
    weights = torch.where(mask, weights, 0.0)
    num = mask.sum().clamp(min=1)
    metrics = {
        "is_weight_mean": weights.sum() / num,
        "is_weight_max": torch.where(mask, raw, 0.0).max() if raw.numel() else raw.new_zeros(()),
        "is_capped_frac": over.sum() / num,
    }
    return weights, metrics


def staleness_metrics(
    policy_version_BT: torch.Tensor,
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    trainer_version: int,
    max_staleness: int,
) -> dict[str, float]:
    """An async step's staleness over its loss tokens (the trainer's version at this update minus
    the version that sampled the token): async/staleness/{mean,max}, async/tokens_per_version,
    and the log-prob gap per staleness s, mismatch/staleness_{s}/abs_diff_mean (|old - rollout|).
    Raises RuntimeError when a token is older than `max_staleness`: admission makes that
    impossible, so it is a bug."""
    mask = loss_mask.bool()
    staleness = (trainer_version - policy_version_BT)[mask]
    if not staleness.numel():
        return {}
    worst = int(staleness.max())
    if worst > max_staleness:
        raise RuntimeError(
            f"async: a trained token is {worst} versions stale (async.max_staleness={max_staleness}): "
            "the admission bound was broken"
        )
    gap = _masked_diff(rollout_logprob, old_logprob, mask).abs()[mask]
    levels = torch.unique(staleness)
    out = {
        "async/staleness/mean": float(staleness.float().mean()),
        "async/staleness/max": float(worst),
        "async/tokens_per_version": float(staleness.numel() / len(levels)),
    }
    for s in levels.tolist():
        out[f"mismatch/staleness_{int(s)}/abs_diff_mean"] = float(gap[staleness == s].mean())
    return out
