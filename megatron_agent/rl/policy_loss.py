"""The PPO clipped policy loss in fp32, with masking before any exp (vanilla and GSPO).

The log-ratio `logprob - old_logprob` is formed in fp32 and masked positions are replaced by 0
with `torch.where` BEFORE the clamp and the exp; advantages and importance weights are masked the
same way. NaN or inf at masked positions therefore reach neither the loss nor the gradient, and
log-prob gaps of any finite size give a finite loss and gradient.

Per token, with r = exp(clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp)) and advantage A:
  loss = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
  where A < 0 (dual clip): loss = min(loss, -A * clip_ratio_c)
  times the rollout importance weight when given.
`loss_mode="gspo"` replaces r by GSPO's sequence-level ratio exp(mean over the sequence's loss
tokens of the log-ratio), with the gradient of each token's own log-prob (GSPO-token form); it
uses no dual clip, and is meant for small clip ranges (e.g. 3e-4 / 4e-4) and
`seq-mean-token-mean`.

The forward pass computes the loss and d loss / d logprob together and a custom autograd function
keeps only that one fp32 tensor for the backward pass. Gradients flow to `logprob` only:
`old_logprob`, `advantages` and `rollout_is_weights` are constants.
"""

from __future__ import annotations

import torch

from megatron_agent.rl.aggregate import agg_loss

LOSS_MODES = ("vanilla", "gspo")


class _ClippedPolicyLoss(torch.autograd.Function):
    """Per-token clipped loss from a (detached) log-ratio value; d/d logprob saved in forward."""

    @staticmethod
    def forward(ctx, logprob, log_ratio, abs_log_ratio, adv, weights, low, high, clip_c, clamp, dual_clip):
        ratio = torch.exp(log_ratio.clamp(-clamp, clamp))
        neg_adv = -adv
        loss1 = neg_adv * ratio
        loss2 = neg_adv * ratio.clamp(1.0 - low, 1.0 + high)
        clipped = loss2 > loss1
        loss = torch.where(clipped, loss2, loss1)
        # d loss / d log_ratio is -A * r (= loss1) where the unclipped branch is taken (ties
        # included, as autograd gives there) and 0 where a clip or the clamp binds. Masked
        # positions have A = 0, hence loss 0 and gradient 0.
        dead = clipped | (abs_log_ratio > clamp)
        if dual_clip:
            loss3 = neg_adv * clip_c
            lower = (neg_adv > 0) & (loss > loss3)
            loss = torch.where(lower, loss3, loss)
            dead |= lower
        else:
            lower = torch.zeros_like(clipped)
        grad = loss1.masked_fill_(dead, 0.0)
        if weights is not None:
            loss = loss * weights
            grad = grad * weights
        ctx.save_for_backward(grad)
        ctx.logprob_dtype = logprob.dtype
        ctx.mark_non_differentiable(clipped, lower)
        return loss, clipped, lower

    @staticmethod
    def backward(ctx, grad_loss, _grad_clipped, _grad_lower):
        (grad,) = ctx.saved_tensors
        return (grad_loss * grad).to(ctx.logprob_dtype), None, None, None, None, None, None, None, None, None


def token_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    log_ratio_clamp: float = 20.0,
    rollout_is_weights: torch.Tensor | None = None,
    loss_mode: str = "vanilla",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped policy loss [B, T] (fp32, 0 at masked positions) and its metrics.

    This is `compute_policy_loss` before aggregation; use it when the per-token losses are
    needed too (e.g. for the guard's culprit report). Metrics as in `compute_policy_loss`.
    """
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"unknown loss_mode {loss_mode!r}; expected one of {', '.join(LOSS_MODES)}")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (the dual-clip bound), got {clip_ratio_c}")
    if not (0.0 <= clip_ratio_low < 1.0) or clip_ratio_high < 0.0:
        raise ValueError(
            f"clip ratios must satisfy 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
            f"got {clip_ratio_low} and {clip_ratio_high}"
        )
    for name, t in (("old_logprob", old_logprob), ("advantages", advantages), ("loss_mask", loss_mask)):
        if t.shape != logprob.shape:
            raise ValueError(f"{name} {tuple(t.shape)} does not match logprob {tuple(logprob.shape)}")
    mask = loss_mask.bool()
    with torch.no_grad():
        log_ratio = torch.where(mask, logprob.detach().float() - old_logprob.float(), 0.0)
        adv = torch.where(mask, advantages.float(), 0.0)
        weights = None
        if rollout_is_weights is not None:
            weights = torch.where(mask, rollout_is_weights.detach().float(), 0.0)
        num_tokens = mask.sum().clamp(min=1)
        abs_log_ratio = log_ratio.abs()
        if loss_mode == "gspo":
            tokens_B = mask.sum(dim=-1, keepdim=True).clamp(min=1)
            seq_log_ratio_B1 = log_ratio.sum(dim=-1, keepdim=True) / tokens_B
            value_log_ratio = torch.where(mask, seq_log_ratio_B1.expand_as(log_ratio), 0.0)
            value_abs_log_ratio = value_log_ratio.abs()
        else:
            value_log_ratio, value_abs_log_ratio = log_ratio, abs_log_ratio
    loss_BT, clipped, lower = _ClippedPolicyLoss.apply(
        logprob,
        value_log_ratio,
        value_abs_log_ratio,
        adv,
        weights,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        log_ratio_clamp,
        loss_mode == "vanilla",
    )
    with torch.no_grad():
        # Masked positions have A = 0 and log-ratio 0: never clipped, never dual-clipped.
        metrics = {
            "pg_clipfrac": clipped.sum() / num_tokens,
            "pg_clipfrac_lower": lower.sum() / num_tokens,
            "ppo_kl": -log_ratio.sum() / num_tokens,
            "max_abs_log_ratio": abs_log_ratio.max() if log_ratio.numel() else log_ratio.new_zeros(()),
        }
    return loss_BT, metrics


def compute_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    log_ratio_clamp: float = 20.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_mode: str = "vanilla",
    num_tokens: int | float | None = None,
    num_seqs: int | float | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped policy loss (asymmetric clip, dual clip for A < 0), aggregated to a scalar.

    Shapes: `logprob` (policy, requires grad), `old_logprob`, `advantages`, `loss_mask` and the
    optional `rollout_is_weights` (truncated importance weights, see `rl.mismatch`) are all
    [B, T]; any float dtype, computed in fp32. `num_tokens` / `num_seqs` / `horizon` are the
    global normalisers of `agg_loss` (pass them when using micro-batches or data parallelism).

    Returns (loss, metrics): metrics are detached scalars over this call's loss tokens:
    `pg_loss`, `pg_clipfrac` (share of tokens where the clipped branch is taken),
    `pg_clipfrac_lower` (share where the dual clip binds), `ppo_kl` (mean of old - new
    log-prob) and `max_abs_log_ratio` (largest |logprob - old_logprob|, before the clamp).
    """
    loss_BT, metrics = token_policy_loss(
        logprob,
        old_logprob,
        advantages,
        loss_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        log_ratio_clamp=log_ratio_clamp,
        rollout_is_weights=rollout_is_weights,
        loss_mode=loss_mode,
    )
    loss = agg_loss(
        loss_BT, loss_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon
    )
    metrics["pg_loss"] = loss.detach()
    return loss, metrics
