"""SFT: masked NLL on assistant tokens, one optimizer step at a time, on a `MegatronModel`.

`sft_step` normalises the loss by the GLOBAL number of loss tokens (all-reduced over the
data-parallel group), so the gradient of a batch does not depend on how it is split over DP
ranks or micro-batches: the schedule sums micro-batch losses and DDP sums gradients (see
`models/forward_backward.py` and docs/rl.md). `sft_batches` gives each step's rows, resumable by
step number; `lr_at` is the warmup + cosine schedule the SFT loop uses.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_agent.platform.setup import device as compute_device


def _loss_fn(global_tokens: float):
    def loss_fn(mb, logp_BT, entropy_BT):
        mask_BT = (mb.extras["loss_mask"] > 0) & mb.valid_BT
        nll_sum = -torch.where(mask_BT, logp_BT.float(), 0.0).sum()
        return nll_sum / global_tokens, {"nll_sum": nll_sum.detach()}

    return loss_fn


def _dp_sum(values: list[float]) -> list[float]:
    """Sum over the data-parallel group (fp64)."""
    from megatron.core import parallel_state as ps

    t = torch.tensor(values, dtype=torch.float64, device=compute_device())
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t.tolist()


def _from_last_stage(values: list[float]) -> list[float]:
    """`values` of the last pipeline stage, on every stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=compute_device())
    dist.broadcast(
        t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    return t.tolist()


def sft_step(
    model,
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    *,
    micro_batch_tokens: int,
    chunk_tokens: int = 1024,
) -> dict[str, float]:
    """One optimizer step of masked NLL on this DP rank's `sequences`.

    `loss_masks[k]` has one entry per id of `sequences[k]` (as `data.sft.tokenize_conversation`
    returns): 1 where the token is trained on. The loss is the sum of -log p over loss tokens of
    every DP rank divided by their global count. Returns, on every rank, `sft/loss` (that global
    mean NLL, before the step), `sft/tokens` (the global count), `actor/grad_norm`, `actor/lr`
    and `sft/update_successful`.
    """
    from megatron.core import parallel_state as ps

    if not sequences:
        raise ValueError("sft_step got no sequences on this rank: give every data-parallel rank at least one")
    targets = []
    for k, (seq, mask) in enumerate(zip(sequences, loss_masks, strict=True)):
        if len(mask) != len(seq):
            raise ValueError(f"loss_masks[{k}] has {len(mask)} entries for {len(seq)} ids; they must match")
        targets.append(torch.as_tensor(list(mask[1:]), dtype=torch.float32))
    (global_tokens,) = _dp_sum([float(sum(float(t.sum()) for t in targets))])
    if global_tokens <= 0:
        raise ValueError("no loss token in the batch on any rank (every loss mask is 0 after the first id)")
    outputs, info = model.train_step(
        sequences,
        _loss_fn(global_tokens),
        extras={"loss_mask": targets},
        max_tokens=micro_batch_tokens,
        chunk_tokens=chunk_tokens,
    )
    local_nll = sum(float(o["nll_sum"]) for o in outputs) if ps.is_pipeline_last_stage() else 0.0
    (nll,) = _from_last_stage(_dp_sum([local_nll]))
    return {
        "sft/loss": nll / global_tokens,
        "sft/tokens": global_tokens,
        "actor/grad_norm": float(info["grad_norm"]),
        "actor/lr": float(model.optimizer.param_groups[0]["lr"]),
        "sft/update_successful": float(info["update_successful"]),
    }


def set_lr(model, lr: float) -> None:
    """Set the learning rate of every parameter group of the model's optimizer."""
    for group in model.optimizer.param_groups:
        group["lr"] = lr


def lr_at(
    step: int, *, lr: float, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.1
) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps` (step from 0)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sft_batches(num_rows: int, batch_size: int, step: int, *, seed: int = 0) -> list[int]:
    """Row indices of global batch `step`: epochs of a seeded shuffle, so a resumed run continues exactly."""
    if batch_size < 1 or num_rows < 1:
        raise ValueError(f"need num_rows >= 1 and batch_size >= 1 (got {num_rows}, {batch_size})")
    start = step * batch_size
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_rows)
        order = list(range(num_rows))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        out += order[offset : offset + batch_size - len(out)]
    return out


def dp_share(indices: list[int], lengths: Sequence[int]) -> list[int]:
    """This data-parallel rank's part of a global batch: rows dealt longest first, to balance tokens."""
    from megatron.core import parallel_state as ps

    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if len(indices) < size:
        raise ValueError(f"a global batch of {len(indices)} rows cannot feed {size} data-parallel ranks")
    ordered = sorted(indices, key=lambda k: -lengths[k])
    return ordered[rank::size]


QUICKSTART_SFT = {"steps": 300, "batch_size": 32, "lr": 2e-3, "warmup_steps": 20, "min_lr_ratio": 0.1}
"""Measured quickstart SFT settings (docs/sft.md): with `data.sft.quickstart_sft_data(2000)` and
`models.tiny.make_quickstart_model`, copying is learned by step ~100 (at lr 1e-3 it is not by 200)."""
