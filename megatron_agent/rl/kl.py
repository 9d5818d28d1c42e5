"""Per-token KL estimators between the policy and the reference, in fp32.

With d = logprob - ref_logprob (the log-ratio, policy over reference):
  k1   d                          (alias `kl`; unbiased, the usual KL-in-reward)
  abs  |d|
  k2   0.5 * d^2                  (alias `mse`; the safe KL loss)
  k3   exp(-d) + d - 1            (alias `low_var_kl`; Schulman's low-variance estimator)
  k1+  value of k1, gradient of k2  (straight-through)
  k3+  value of k3, gradient of k2  (straight-through; the recommended KL loss)
k3's gradient grows like exp(-d) when the policy gives a token far less probability than the
reference, which is why k2 or k3+ are the safe choices for a KL *loss*. Before any exp the
log-ratio is clamped to [-20, 20], and k3 is clamped to [-10, 10], so the value and the gradient
are finite for any finite inputs (the clamps zero the gradient where they bind).

The value and its gradient coefficient are computed in one pass under a custom autograd function
that saves one fp32 tensor, which is both faster and leaner than autograd over the formula.
"""

from __future__ import annotations

import torch

from megatron_agent.rl.aggregate import agg_loss

KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "k1+", "k3+")
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
_EXP_CLAMP = 20.0
_K3_CLAMP = 10.0


def canonical_kl_estimator(estimator: str) -> str:
    """Resolve aliases (`kl`, `mse`, `low_var_kl`); raise `ValueError` for an unknown name."""
    name = KL_ALIASES.get(estimator, estimator)
    if name not in KL_ESTIMATORS:
        valid = ", ".join(KL_ESTIMATORS + tuple(KL_ALIASES))
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {valid}")
    return name


def _value_and_grad(neg_d: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Estimator value and its derivative in d = logprob - ref, from neg_d = -d.

    A derivative of None means 1 everywhere (k1).
    """
    if name == "k1":
        return -neg_d, None
    if name == "abs":
        return neg_d.abs(), -torch.sign(neg_d)
    if name in ("k2", "k1+"):
        d = -neg_d
        return (0.5 * d * d if name == "k2" else d), d
    x = neg_d.clamp(-_EXP_CLAMP, _EXP_CLAMP)
    raw = torch.expm1(x) - x  # exp(-d) + d - 1, >= 0
    value = raw.clamp(max=_K3_CLAMP)
    if name == "k3+":
        return value, -neg_d
    # d/dd k3 = 1 - exp(-d); zero where either clamp binds (as autograd would give).
    live = (neg_d.abs() <= _EXP_CLAMP) & (raw <= _K3_CLAMP)
    return value, torch.where(live, -torch.expm1(x), 0.0)


class _KLPenalty(torch.autograd.Function):
    """Value of the estimator; gradient coefficient saved from the same pass."""

    @staticmethod
    def forward(ctx, logprob, ref_logprob, mask, name):
        neg_d = ref_logprob.float() - logprob.float()
        if mask is not None:
            neg_d = torch.where(mask, neg_d, 0.0)
        value, grad = _value_and_grad(neg_d, name)
        # k1: d value / d logprob is 1 except where masked, so only the mask is kept.
        ctx.save_for_backward(mask if grad is None else grad)
        ctx.has_coef = grad is not None
        ctx.dtypes = (logprob.dtype, ref_logprob.dtype)
        return value

    @staticmethod
    def backward(ctx, grad_out):
        (saved,) = ctx.saved_tensors
        if ctx.has_coef:
            g = grad_out * saved
        else:
            g = grad_out if saved is None else torch.where(saved, grad_out, 0.0)
        g_logprob = g.to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        g_ref = (-g).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return g_logprob, g_ref, None, None


def kl_penalty(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    estimator: str = "k3+",
    *,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate [B, T] in fp32 (see the module docstring for the estimators).

    `logprob` and `ref_logprob` are log-probabilities of the same tokens, any float dtype.
    Pass `loss_mask` (bool [B, T]) whenever masked positions may hold garbage: they are set to a
    log-ratio of 0 before any arithmetic, so NaN or inf there cannot reach value or gradient
    (a multiply-by-mask afterwards would give NaN * 0 = NaN in the backward pass).
    """
    name = canonical_kl_estimator(estimator)
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob {tuple(logprob.shape)} and ref_logprob {tuple(ref_logprob.shape)} differ")
    mask = None if loss_mask is None else loss_mask.bool()
    return _KLPenalty.apply(logprob, ref_logprob, mask, name)


def compute_kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    estimator: str = "k3+",
    loss_agg_mode: str = "token-mean",
    num_tokens: int | float | None = None,
    num_seqs: int | float | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KL loss term: masked per-token `kl_penalty`, aggregated with `agg_loss`.

    Returns (loss, metrics) with metrics `kl_loss` (the loss, detached) and `kl_max` (the
    largest per-token estimate; masked positions count as 0, the KL of identical policies). Multiply by the KL coefficient yourself.
    """
    mask = loss_mask.bool()
    kl_BT = kl_penalty(logprob, ref_logprob, estimator, loss_mask=mask)
    loss = agg_loss(kl_BT, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    with torch.no_grad():
        kl_max = kl_BT.max() if kl_BT.numel() else kl_BT.new_zeros(())
    return loss, {"kl_loss": loss.detach(), "kl_max": kl_max}


def apply_kl_in_reward(
    token_rewards_BT: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask_BT: torch.Tensor,
    kl_coef: float,
    *,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE++-style KL in the reward: rewards - kl_coef * KL per response token (no grad).

    Returns (rewards_BT fp32, metrics) where metrics hold `kl_reward` (mean per-token KL over
    response tokens, the value a KL controller is updated with) and `kl_coef`. Masked positions
    keep their reward and get no penalty.
    """
    mask = response_mask_BT.bool()
    with torch.no_grad():
        kl_BT = kl_penalty(logprob.detach(), ref_logprob.detach(), estimator, loss_mask=mask)
        rewards_BT = token_rewards_BT.float() - kl_coef * kl_BT
        num_tokens = mask.sum().clamp(min=1)
        mean_kl = kl_BT.sum() / num_tokens
    return rewards_BT, {"kl_reward": mean_kl, "kl_coef": torch.tensor(float(kl_coef))}
