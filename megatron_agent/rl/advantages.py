"""Advantage estimators: GRPO (and Dr.GRPO), RLOO, REINFORCE++ (and its baseline variant),
ReMax and GAE. All run without gradients, in fp32, on [B, T] response tensors.

Conventions:
- `token_rewards_BT` holds rewards per response token; positions outside `response_mask_BT` are
  ignored (put a trajectory's outcome reward on one of its loss tokens, usually the last).
  An outcome score is the sum of a row's rewards over its response tokens.
- Masked positions inside a response (tool output, template, injected tokens) are not actions:
  discounted returns and GAE pass through them unchanged, so credit flows across turns.
- Degenerate inputs give zero advantages and no NaN: a group of one, a group whose scores are
  all equal, a batch with fewer than two loss tokens for whitening, and zero-length responses.
- Group statistics use the unbiased standard deviation (n - 1), like torch.std.
Advantages and returns are 0 at masked positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae")


def group_index(group_ids: Sequence | torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map per-row group ids (any hashables, or an int tensor [B]) to dense indices [B]."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    if len(group_ids) != batch_size:
        raise ValueError(f"group_ids has {len(group_ids)} entries but the batch has {batch_size} rows")
    dense: dict = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def _group_stats(scores_B: torch.Tensor, index_B: torch.Tensor, num_groups: int):
    """Per-row (group size, group mean, group unbiased std, group all-equal flag)."""
    index_B = index_B.to(scores_B.device)
    size_G = torch.zeros(num_groups, device=scores_B.device).index_add_(0, index_B, torch.ones_like(scores_B))
    sum_G = torch.zeros(num_groups, device=scores_B.device).index_add_(0, index_B, scores_B)
    mean_G = sum_G / size_G
    sq_G = torch.zeros(num_groups, device=scores_B.device).index_add_(
        0, index_B, (scores_B - mean_G[index_B]) ** 2
    )
    std_G = torch.sqrt(sq_G / (size_G - 1).clamp(min=1))
    inf = torch.full((num_groups,), float("inf"), device=scores_B.device)
    max_G = (-inf).scatter_reduce(0, index_B, scores_B, reduce="amax")
    min_G = inf.scatter_reduce(0, index_B, scores_B, reduce="amin")
    flat_G = (max_G == min_G) | (size_G < 2)
    return size_G[index_B], mean_G[index_B], std_G[index_B], flat_G[index_B]


def _whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over masked tokens (unbiased std); 0 if degenerate or masked."""
    num = mask_BT.sum()
    if num < 2:
        return torch.zeros_like(x_BT)
    x = torch.where(mask_BT, x_BT, 0.0)
    mean = x.sum() / num
    centered = torch.where(mask_BT, x_BT - mean, 0.0)
    std = torch.sqrt((centered**2).sum() / (num - 1))
    values = torch.where(mask_BT, x_BT, mean)
    if bool(values.max() == values.min()):
        return torch.zeros_like(x_BT)
    return centered / (std + eps)


def _discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """Returns-to-go over loss tokens; masked positions are skipped (neither reward nor step)."""
    if gamma == 1.0:
        # Rewards are already 0 at masked positions: a reversed cumulative sum is exact.
        returns_BT = rewards_BT.flip(-1).cumsum(-1).flip(-1)
        return torch.where(mask_BT, returns_BT, 0.0)
    running_B = torch.zeros_like(rewards_BT[:, 0])
    returns_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(rewards_BT.shape[1])):
        m = mask_BT[:, t]
        running_B = torch.where(m, rewards_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = torch.where(m, running_B, 0.0)
    return returns_BT


def _gae(rewards_BT, values_BT, mask_BT, gamma: float, lam: float):
    """GAE over loss tokens, passing masked positions through; returns (advantages, returns)."""
    next_value_B = torch.zeros_like(rewards_BT[:, 0])
    last_gae_B = torch.zeros_like(rewards_BT[:, 0])
    adv_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(rewards_BT.shape[1])):
        m = mask_BT[:, t]
        value_B = torch.where(m, values_BT[:, t], 0.0)
        delta_B = rewards_BT[:, t] + gamma * next_value_B - value_B
        gae_B = delta_B + gamma * lam * last_gae_B
        next_value_B = torch.where(m, value_B, next_value_B)
        last_gae_B = torch.where(m, gae_B, last_gae_B)
        adv_BT[:, t] = torch.where(m, gae_B, 0.0)
    returns_BT = torch.where(mask_BT, adv_BT + torch.where(mask_BT, values_BT, 0.0), 0.0)
    return adv_BT, returns_BT


@torch.no_grad()
def gae_returns(
    token_rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """The critic's targets [B, T] of estimator 'gae': values + GAE(`gamma`, `lam`), 0 at masked
    positions. Each row is computed from that row alone, with the same operations as
    `compute_advantages`, so a sub-batch (a micro-batch, another padding length) gives its rows'
    returns bit for bit (the critic's update computes them from its own forward's values)."""
    mask = response_mask_BT.bool()
    rewards = torch.where(mask, token_rewards_BT.float(), 0.0)
    return _gae(rewards, values_BT.float(), mask, gamma, lam)[1]


@torch.no_grad()
def compute_advantages(
    estimator: str,
    token_rewards_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    group_ids: Sequence | torch.Tensor | None = None,
    values_BT: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    baseline_rewards_B: torch.Tensor | None = None,
    whiten_gae: bool = True,
    lam_critic: float | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns [B, T] (fp32, 0 at masked positions) for one rollout batch.

    estimator:
      grpo                          (score - group mean) / (group std + eps); `norm_by_std=False`
                                    skips the division (Dr.GRPO). Needs `group_ids`.
      rloo                          score minus the mean of the other samples of its group.
      reinforce_plus_plus           discounted returns (`gamma`), whitened over the batch.
      reinforce_plus_plus_baseline  score minus group mean, broadcast, whitened over the batch.
      remax                         returns-to-go minus `baseline_rewards_B` (the greedy
                                    rollout's reward of each row).
      gae                           GAE(`gamma`, `lam`) with `values_BT`; whitened unless
                                    `whiten_gae=False`. Returns (the critic's targets) are
                                    values + GAE(`gamma`, `lam_critic`), `lam_critic`
                                    defaulting to `lam`.
    Outcome estimators (grpo, rloo, rpp-baseline) return the broadcast advantage as returns;
    reinforce_plus_plus and remax return the (unwhitened) returns-to-go.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}"
        )
    if token_rewards_BT.shape != response_mask_BT.shape or token_rewards_BT.dim() != 2:
        raise ValueError(
            f"token_rewards_BT {tuple(token_rewards_BT.shape)} and response_mask_BT "
            f"{tuple(response_mask_BT.shape)} must be the same [B, T] shape"
        )
    mask = response_mask_BT.bool()
    rewards = torch.where(mask, token_rewards_BT.float(), 0.0)
    num_rows = rewards.shape[0]
    has_tokens_B = mask.any(dim=-1)

    if estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        if group_ids is None:
            raise ValueError(
                f"advantage estimator {estimator!r} needs group_ids (one id per row, e.g. the prompt uid)"
            )
        index_B, num_groups = group_index(group_ids, num_rows)
        scores_B = rewards.sum(dim=-1)
        size_B, mean_B, std_B, flat_B = _group_stats(scores_B, index_B, num_groups)
        if estimator == "grpo":
            adv_B = scores_B - mean_B
            if norm_by_std:
                adv_B = adv_B / (std_B + eps)
        elif estimator == "rloo":
            adv_B = (scores_B - mean_B) * size_B / (size_B - 1).clamp(min=1)
        else:
            adv_B = scores_B - mean_B
        adv_B = torch.where(flat_B | ~has_tokens_B, 0.0, adv_B)
        adv_BT = torch.where(mask, adv_B[:, None], 0.0)
        if estimator == "reinforce_plus_plus_baseline":
            return _whiten(adv_BT, mask, eps), adv_BT
        return adv_BT, adv_BT

    if estimator == "reinforce_plus_plus":
        returns_BT = _discounted_returns(rewards, mask, gamma)
        return _whiten(returns_BT, mask, eps), returns_BT

    if estimator == "remax":
        if baseline_rewards_B is None:
            raise ValueError(
                "advantage estimator 'remax' needs baseline_rewards_B (the greedy rollout's rewards)"
            )
        returns_BT = _discounted_returns(rewards, mask, 1.0)
        baseline_B = baseline_rewards_B.float().to(rewards.device).reshape(num_rows)
        return torch.where(mask, returns_BT - baseline_B[:, None], 0.0), returns_BT

    if values_BT is None:
        raise ValueError("advantage estimator 'gae' needs values_BT (the critic's values per token)")
    if values_BT.shape != mask.shape:
        raise ValueError(f"values_BT {tuple(values_BT.shape)} does not match the rewards {tuple(mask.shape)}")
    adv_BT, returns_BT = _gae(rewards, values_BT.float(), mask, gamma, lam)
    if lam_critic is not None and lam_critic != lam:
        returns_BT = gae_returns(rewards, values_BT, mask, gamma=gamma, lam=lam_critic)
    return (_whiten(adv_BT, mask, eps) if whiten_gae else adv_BT), returns_BT
