"""What one Megatron rank computes for the RL step: log-probs, and the PPO update with the guard.

Everything here runs inside a worker on every rank of the Megatron world at the same time (the
pipeline schedule and the collectives need all of them). Each data-parallel replica takes its
share of the sequences (`batch.dp_shard`); losses are normalised by counts all-reduced over the
data-parallel group, so the gradient does not depend on the split. Metrics come back as sums
(with their token counts) from the last pipeline stage, for the driver to combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_agent.models.forward_backward import forward_backward, make_micro_batches
from megatron_agent.rl import GuardBatch, StepGuard, agg_loss, compute_kl_loss, compute_policy_loss
from megatron_agent.rl.aggregate import global_batch_counts
from megatron_agent.rl.mismatch import rollout_is_weights
from megatron_agent.train.batch import RLBatch, dp_shard, host_row, keep_rows
from megatron_agent.train.update_metrics import accumulate


@dataclass
class ParallelInfo:
    """Where this rank sits in the Megatron world."""

    rank: int
    dp_rank: int
    dp_size: int
    is_last_stage: bool
    tp_rank: int

    @property
    def reports(self) -> bool:
        """True on the one rank per data-parallel replica that returns results (last stage, TP 0)."""
        return self.is_last_stage and self.tp_rank == 0


def parallel_info() -> ParallelInfo:
    """This rank's `ParallelInfo` from Megatron's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return ParallelInfo(
        rank=dist.get_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
        tp_rank=ps.get_tensor_model_parallel_rank(),
    )


@torch.no_grad()
def shard_logprobs(
    model,
    sequences: list[list[int]],
    *,
    micro_batch_tokens: int,
    with_entropy: bool,
    chunk_tokens: int = 1024,
) -> tuple[list[int], list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Forward-only log-probs (and entropy) of this DP rank's share of `sequences`; a critic's
    values (`MegatronModel.forward_only` of a value model; no entropy).

    Returns (indices of the share, log-probs [L-1] each, entropy [L-1] each or None), as
    `host_row` arrays for the driver, only on the last pipeline stage (None elsewhere).
    """
    info = parallel_info()
    indices = dp_shard(list(range(len(sequences))), info.dp_rank, info.dp_size)
    logp, entropy = model.forward_only(
        [sequences[i] for i in indices],
        max_tokens=micro_batch_tokens,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
    )
    model.offload()
    if logp is None:
        return indices, None, None
    return indices, [host_row(t) for t in logp], None if entropy is None else [host_row(t) for t in entropy]


def dp_loss_counts(micro_batches: list):
    """Loss tokens and sequences of the micro-batches, summed over the data-parallel group (what
    every replica's loss is normalised by, so the gradient does not depend on the split)."""
    from megatron.core import parallel_state as ps

    return global_batch_counts(
        [mb.extras["loss_mask"].bool() for mb in micro_batches], group=ps.get_data_parallel_group()
    )


def zero_grads(model) -> None:
    """Train mode and zeroed gradient buffers before a forward-backward of `model`."""
    for chunk in model.chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    model.optimizer.zero_grad()


def guarded_step(model, guard: StepGuard, scheduler, step_index: int, outputs: list[dict]):
    """The guard's decision on optimizer step `step_index` (the micro-batches' losses and the
    gradients in Megatron's buffers), then the optimizer and schedule step unless it skips.
    Returns (decision, grad norm; NaN when skipped). Every rank gets the same decision."""
    losses = [out["loss"] for out in outputs if "loss" in out]
    grads = [
        p.main_grad for c in model.chunks for p in c.parameters() if getattr(p, "main_grad", None) is not None
    ]
    decision = guard.check(step_index, loss=losses or None, grads=grads)
    grad_norm = float("nan")
    if not decision.skip:
        _, norm_value, _ = model.optimizer.step()
        grad_norm = float(norm_value) if norm_value is not None else float("nan")
        scheduler.step(1)
    return decision, grad_norm


class PPOUpdate:
    """The actor's optimisation for RL steps: PPO epochs over mini-batches, the guard, the LR schedule."""

    def __init__(
        self,
        model,
        algorithm,
        actor,
        guard: StepGuard,
        scheduler,
        *,
        horizon: int,
        old_from_update: bool,
        rollout_is: tuple[str, str] | None = None,
        chunk_tokens: int = 1024,
    ):
        """`algorithm`/`actor`: the config sections; `horizon`: Dr.GRPO's constant length;
        `old_from_update`: take old log-probs from this forward (`RunPlan.old_logprobs_from_update`);
        `rollout_is`: (level, mode) of the rollout IS weights that the loss then computes from
        them (`RunPlan.rollout_is`, `rollout_is_mode`), None for none; `chunk_tokens`: tokens
        per chunk of the log-prob head (`model.logprob_chunk_tokens`)."""
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.old_from_update = old_from_update
        self.rollout_is = rollout_is if old_from_update else None
        self.captured: dict[str, list] = {}
        self.algo = algorithm
        self.actor = actor
        self.guard = guard
        self.scheduler = scheduler
        self.horizon = algorithm.loss_agg_horizon or horizon
        self.optimizer_steps = 0

    def run(self, batch: RLBatch, mini_batch_indices: list[list[int]], step: int, decode=None) -> dict:
        """Every epoch over every mini-batch; returns metric sums (last stage, TP rank 0) or {}."""
        totals: dict[str, float] = {}
        self.captured = {"indices": [], "old": [], "entropy": []}
        for _ in range(self.actor.ppo_epochs):
            for indices in mini_batch_indices:
                accumulate(totals, self._optimizer_step(batch, indices, step, decode))  # update_metrics.py
        return totals

    def _optimizer_step(self, batch: RLBatch, indices: list[int], step: int, decode) -> dict:
        from megatron_agent.platform.setup import device

        info = parallel_info()
        mine = dp_shard(indices, info.dp_rank, info.dp_size)
        sub = batch.select(mine)
        micro_batches = self.micro_batches(sub, device())
        counts = dp_loss_counts(micro_batches)
        sums = {}
        use_entropy = self.algo.entropy_coef != 0.0

        def loss_fn(mb, logp_BT, entropy_BT):
            mask = mb.extras["loss_mask"].bool() & mb.valid_BT
            if self.old_from_update:
                mb.extras["old_logp"] = logp_BT.detach()
                # the step's `old_logp` and `entropy`, row by row
                keep_rows(
                    self.captured,
                    mb,
                    [mine[i] for i in mb.indices],
                    old=mb.extras["old_logp"],
                    entropy=entropy_BT,
                )
                if self.rollout_is is not None:
                    mb.extras["is_weights"] = self.is_weights(mb.extras, mask)
            loss, metrics = self.objective(
                mb.extras, logp_BT, entropy_BT, mask, num_tokens=counts.num_tokens, num_seqs=counts.num_seqs
            )
            rollout = torch.where(mask, mb.extras["rollout_logp"], float("nan"))
            self.guard.observe(
                GuardBatch(
                    logprob=logp_BT,
                    old_logprob=mb.extras["old_logp"],
                    advantages=mb.extras["advantages"],
                    loss_mask=mask,
                    rollout_logprob=rollout,
                    ref_logprob=mb.extras.get("ref_logp"),
                    token_ids=mb.targets_BT,
                    sample_ids=[sub.uids[i] for i in mb.indices],
                    decode=decode,
                )
            )
            return loss, metrics

        zero_grads(self.model)
        outputs = forward_backward(
            self.model.chunks,
            micro_batches,
            true_vocab_size=self.model.true_vocab_size,
            loss_fn=loss_fn,
            with_entropy=use_entropy or self.old_from_update,
            chunk_tokens=self.chunk_tokens,
        )
        decision, grad_norm = guarded_step(
            self.model, self.guard, self.scheduler, self.optimizer_steps, outputs
        )
        self.optimizer_steps += 1
        if info.reports:
            for out in outputs:
                for key, value in out.items():
                    if key.startswith("actor/") or key == "n_tokens":
                        sums[key] = sums.get(key, 0.0) + float(value)
            sums["actor/grad_norm"] = grad_norm
            sums["n_optimizer_steps"] = 1.0
            sums["guard/skipped"] = float(decision.skip)
            for key, value in decision.metrics.items():
                sums[key] = float(value)
        return sums

    def micro_batches(self, sub: RLBatch, device) -> list:
        """`sub`'s sequences in micro-batches of `actor.micro_batch_tokens`, with the loss's tensors."""
        keys = [
            k
            for k in ("loss_mask", "rollout_logp", "old_logp", "ref_logp", "advantages", "is_weights")
            if k in sub.tensors
        ]
        return make_micro_batches(
            sub.sequences,
            max_tokens=self.actor.micro_batch_tokens,
            extras={k: sub.tensors[k] for k in keys},
            device=device,
        )

    def objective(self, extras: dict, logp_BT, entropy_BT, mask, *, num_tokens, num_seqs) -> tuple:
        """(loss, metrics) of one micro-batch (`algorithm`'s policy loss, KL loss and entropy bonus)."""
        algo = self.algo
        norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, horizon=self.horizon)
        loss, m = compute_policy_loss(
            logp_BT,
            extras["old_logp"],
            extras["advantages"],
            mask,
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            clip_ratio_c=algo.clip_ratio_c,
            log_ratio_clamp=algo.log_ratio_clamp,
            loss_agg_mode=algo.loss_agg_mode,
            rollout_is_weights=extras.get("is_weights"),
            loss_mode=algo.policy_loss_mode,
            **norm,
        )
        num_local = mask.sum().float()
        metrics = {
            "actor/pg_loss": m["pg_loss"],
            "n_tokens": num_local,
            "actor/pg_clipfrac": m["pg_clipfrac"] * num_local,
            "actor/ppo_kl": m["ppo_kl"] * num_local,
        }
        if algo.kl_loss_coef:
            kl, _ = compute_kl_loss(
                logp_BT,
                extras["ref_logp"],
                mask,
                estimator=algo.kl_loss_estimator,
                loss_agg_mode=algo.loss_agg_mode,
                **norm,
            )
            loss = loss + algo.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        if algo.entropy_coef != 0.0:
            loss = loss - algo.entropy_coef * agg_loss(entropy_BT, mask, algo.loss_agg_mode, **norm)
        return loss, metrics

    def is_weights(self, extras: dict, mask) -> torch.Tensor:
        """The rollout IS weights pi_old / pi_engine [B, T] of one micro-batch whose old (proximal)
        log-probs are its own detached forward: what the driver computes before the update when a
        forward-only pass gives them (`rl_loop.importance_weights`)."""
        level, mode = self.rollout_is
        weights, _ = rollout_is_weights(
            extras["rollout_logp"],
            extras["old_logp"],
            mask,
            level=level,
            cap=self.algo.rollout_is_cap,
            mode=mode,
        )
        return weights

    def current_lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.model.optimizer.param_groups[0]["lr"])
