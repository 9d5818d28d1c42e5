"""Loss aggregation over tokens and sequences, exact across micro-batches and data-parallel ranks.

Every mode is a masked sum divided by a normaliser. When the caller passes the normaliser of the
whole mini-batch (`num_tokens` / `num_seqs`, counted once over every micro-batch and every
data-parallel rank, see `global_batch_counts`), the per-micro-batch losses SUM to the mean over
the global batch, so accumulating gradients over micro-batches and summing them over ranks gives
exactly the gradient of the global loss. Without those arguments the local counts are used
(correct for one micro-batch on one rank only).

Note on data parallelism: these losses are already divided by global counts, so gradients must be
SUMMED over data-parallel ranks. Megatron's DDP averages them (divides by the DP size) unless
`calculate_per_token_loss` is set; in that case multiply the loss by the DP size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class BatchCounts:
    """Loss-token and sequence counts of a whole mini-batch (all micro-batches, all DP ranks)."""

    num_tokens: int
    """Loss-bearing tokens (mask true)."""
    num_seqs: int
    """Sequences with at least one loss-bearing token."""


def check_agg_mode(mode: str) -> None:
    """Raise `ValueError` naming the valid modes when `mode` is not one of them."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(AGG_MODES)}")


def local_batch_counts(mask_BT: torch.Tensor) -> tuple[int, int]:
    """(loss tokens, sequences with a loss token) of one mask [B, T]."""
    mask_BT = mask_BT.bool()
    return int(mask_BT.sum()), int(mask_BT.any(dim=-1).sum())


def global_batch_counts(
    masks_BT: torch.Tensor | Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> BatchCounts:
    """Count loss tokens and sequences over all micro-batch masks, summed over `group`.

    `masks_BT` is one mask [B, T] or the masks of every micro-batch of the mini-batch on this
    rank. With torch.distributed initialised the counts are all-reduced (SUM) over `group`
    (default: the world); otherwise they are local. Call it once per mini-batch, before the
    micro-batch loop, and pass the result to `agg_loss`.
    """
    if isinstance(masks_BT, torch.Tensor):
        masks_BT = [masks_BT]
    num_tokens = num_seqs = 0
    device = torch.device("cpu")
    for mask_BT in masks_BT:
        tokens, seqs = local_batch_counts(mask_BT)
        num_tokens += tokens
        num_seqs += seqs
        device = mask_BT.device
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        counts = torch.tensor([num_tokens, num_seqs], dtype=torch.int64, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        num_tokens, num_seqs = (int(c) for c in counts.tolist())
    return BatchCounts(num_tokens=num_tokens, num_seqs=num_seqs)


def agg_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: int | float | None = None,
    num_seqs: int | float | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Aggregate per-token losses [B, T] into a scalar (fp32), ignoring masked positions.

    Modes (n = `num_tokens`, S = `num_seqs`, both global when given, else counted locally):
      token-mean               sum of unmasked losses / n
      seq-mean-token-sum       sum over sequences of (sum over their tokens) / S
      seq-mean-token-mean      sum over sequences of (mean over their tokens) / S
      seq-mean-token-sum-norm  sum of unmasked losses / (S * horizon)  (Dr.GRPO; `horizon` is a
                               constant such as the maximum response length, default T)
    Masked positions are removed with `torch.where`, so NaN or inf there reach neither the value
    nor the gradient. A normaliser of zero (no loss token anywhere) gives a loss of 0.
    """
    check_agg_mode(mode)
    if loss_BT.shape != mask_BT.shape:
        raise ValueError(f"loss_BT {tuple(loss_BT.shape)} and mask_BT {tuple(mask_BT.shape)} differ in shape")
    mask_BT = mask_BT.bool()
    masked_BT = torch.where(mask_BT, loss_BT.float(), 0.0)
    if mode == "token-mean":
        denom = local_batch_counts(mask_BT)[0] if num_tokens is None else num_tokens
        return masked_BT.sum() / max(float(denom), 1.0)
    denom = local_batch_counts(mask_BT)[1] if num_seqs is None else num_seqs
    denom = max(float(denom), 1.0)
    if mode == "seq-mean-token-sum":
        return masked_BT.sum() / denom
    if mode == "seq-mean-token-mean":
        tokens_B = mask_BT.sum(dim=-1).clamp(min=1).float()
        return (masked_BT.sum(dim=-1) / tokens_B).sum() / denom
    if horizon is None:
        horizon = loss_BT.shape[-1]
    if horizon <= 0:
        raise ValueError(f"horizon must be positive for seq-mean-token-sum-norm, got {horizon}")
    return masked_BT.sum() / (denom * float(horizon))
