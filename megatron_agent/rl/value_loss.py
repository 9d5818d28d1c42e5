"""The critic's loss and diagnostics, in fp32 over an explicit mask.

Clipped value loss (PPO's): the new value may move at most `cliprange_value` from the value the
rollout was scored with (`old_values`) before the clip stops its gradient, and the larger of the
clipped and unclipped squared errors is taken:

    loss_t = 0.5 * max((v_t - R_t)^2, (old_t + clip(v_t - old_t, -c, c) - R_t)^2)

summed over loss tokens and divided by `normalizer` (the global count of loss tokens, so that
micro-batches and data-parallel ranks add up to the token mean: rl/aggregate.py). Masked
positions are removed with `where` before anything is squared.
"""

from __future__ import annotations

import torch


def clipped_value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    cliprange_value: float,
    normalizer: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, sums) for one micro-batch: the loss is the masked sum of the clipped value loss
    divided by `normalizer`; `sums` holds `vf_loss_sum`, `vf_clipped_sum` (tokens where the clip
    binds and its error is the larger: no gradient) and `vpred_sum` over the loss tokens, for
    metrics."""
    mask = mask_BT.bool()
    values = torch.where(mask, values_BT.float(), 0.0)
    old = torch.where(mask, old_values_BT.float(), 0.0)
    returns = torch.where(mask, returns_BT.float(), 0.0)
    clipped = old + (values - old).clamp(-cliprange_value, cliprange_value)
    unclipped_err, clipped_err = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_err, clipped_err)
    loss_sum = torch.where(mask, per_token, 0.0).sum()
    # Where the clip does not bind, `clipped` equals `values` up to rounding: not counted.
    binds = ((values - old).abs() > cliprange_value) & (clipped_err > unclipped_err)
    sums = {
        "vf_loss_sum": loss_sum.detach(),
        "vf_clipped_sum": torch.where(mask & binds, 1.0, 0.0).sum(),
        "vpred_sum": values.detach().sum(),
    }
    return loss_sum / normalizer, sums


def explained_variance(values_N: torch.Tensor, returns_N: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the whole batch's loss tokens (flattened),
    NaN when the returns do not vary (nothing to explain: a batch whose rewards all tie gives
    returns equal up to rounding, whose variance would blow the ratio up)."""
    returns, values = returns_N.double().flatten(), values_N.double().flatten()
    var_returns = returns.var(unbiased=False)
    if returns.numel() < 2 or var_returns <= 1e-12 * max(1.0, float(returns.abs().max()) ** 2):
        return float("nan")
    return float(1.0 - (returns - values).var(unbiased=False) / var_returns)
