"""What one Megatron rank computes for the critic's update (`algorithm.adv_estimator=gae`), with
its own guard and LR schedule (its values before the update: `actor_update.shard_logprobs`).

Like the actor's (actor_update.py): every rank of the world runs it at once, each data-parallel
replica takes its share of the sequences, the loss is normalised by the loss tokens all-reduced
over the data-parallel group, metrics come back as sums from the reporting ranks. The critic
trains on the actor's mini-batches, `critic.ppo_epochs` times, towards the returns of the step's
GAE, with the clipped value loss of rl/value_loss.py around the values the rollout was scored
with. When the values come from the update itself (`RunPlan.values_from_update`: one epoch, one
mini-batch), each micro-batch's forward gives its values, detached, and its returns are computed
there from the step's token rewards (`rl.advantages.gae_returns`: GAE runs within a sequence);
the values are kept, row by row, for the driver's advantages. Its guard checks the loss and the
gradients before every optimizer step: a non-finite one skips the step on every rank (weights
and optimizer state unchanged) and writes a report.
"""

from __future__ import annotations

from megatron_agent.models.forward_backward import forward_backward, make_micro_batches
from megatron_agent.rl import StepGuard
from megatron_agent.rl.advantages import gae_returns
from megatron_agent.rl.value_loss import clipped_value_loss
from megatron_agent.train.actor_update import dp_loss_counts, guarded_step, parallel_info, zero_grads
from megatron_agent.train.batch import RLBatch, dp_shard, keep_rows
from megatron_agent.train.update_metrics import accumulate


class CriticUpdate:
    """The critic's optimisation for RL steps: epochs over mini-batches, the guard, the LR schedule."""

    def __init__(
        self,
        model,
        critic,
        guard: StepGuard,
        scheduler,
        *,
        micro_batch_tokens: int,
        values_from_update: bool = False,
        gamma: float = 1.0,
        lam: float = 1.0,
    ):
        """`critic`: the config section; `micro_batch_tokens`: the actor's token budget;
        `values_from_update`: take the values from this forward and compute the returns here
        with `gamma` and `lam` (the critic's: `algorithm.lam_critic` or `lam`); the batch then
        holds `token_rewards`, not `values` and `returns`."""
        self.model, self.critic, self.guard, self.scheduler = model, critic, guard, scheduler
        self.micro_batch_tokens = micro_batch_tokens
        self.values_from_update, self.gamma, self.lam = values_from_update, gamma, lam
        self.captured: dict[str, list] = {}
        self.optimizer_steps = 0

    def run(self, batch: RLBatch, mini_batch_indices: list[list[int]]) -> dict:
        """Every epoch over every mini-batch; metric sums (last stage, TP rank 0) or {}. With
        `values_from_update`, `captured` then holds this replica's values (indices, rows)."""
        totals: dict[str, float] = {}
        self.captured = {"indices": [], "values": []}
        for _ in range(self.critic.ppo_epochs):
            for indices in mini_batch_indices:
                accumulate(totals, self._optimizer_step(batch, indices))  # update_metrics.py
        return totals

    def _optimizer_step(self, batch: RLBatch, indices: list[int]) -> dict:
        from megatron_agent.platform.setup import device

        info = parallel_info()
        mine = dp_shard(indices, info.dp_rank, info.dp_size)
        sub = batch.select(mine)
        keys = (
            ("loss_mask", "token_rewards") if self.values_from_update else ("loss_mask", "values", "returns")
        )
        micro_batches = make_micro_batches(
            sub.sequences,
            max_tokens=self.micro_batch_tokens,
            extras={k: sub.tensors[k] for k in keys},
            device=device(),
        )
        counts = dp_loss_counts(micro_batches)

        def loss_fn(mb, values_BT, _):
            mask = mb.extras["loss_mask"].bool() & mb.valid_BT
            if self.values_from_update:
                self._values_of_forward(mb, values_BT, mask, [mine[i] for i in mb.indices])
            loss, sums = clipped_value_loss(
                values_BT,
                mb.extras["values"],
                mb.extras["returns"],
                mask,
                cliprange_value=self.critic.cliprange_value,
                normalizer=counts.num_tokens,
            )
            return loss, {
                "critic/vf_loss": loss.detach(),
                "critic/vf_clipfrac": sums["vf_clipped_sum"],
                "critic/vpred_mean": sums["vpred_sum"],
                "n_tokens": mask.sum().float(),
            }

        zero_grads(self.model)
        outputs = forward_backward(
            self.model.chunks,
            micro_batches,
            true_vocab_size=self.model.true_vocab_size,
            loss_fn=loss_fn,
            head="values",
        )
        decision, grad_norm = guarded_step(
            self.model, self.guard, self.scheduler, self.optimizer_steps, outputs
        )
        self.optimizer_steps += 1
        sums: dict[str, float] = {}
        if info.reports:
            for out in outputs:
                for key, value in out.items():
                    if key.startswith("critic/") or key == "n_tokens":
                        sums[key] = sums.get(key, 0.0) + float(value)
            sums["critic/grad_norm"] = grad_norm
            sums["critic/guard_skipped"] = float(decision.skip)
            sums["n_optimizer_steps"] = 1.0
        return sums

    def _values_of_forward(self, mb, values_BT, mask, batch_indices: list[int]) -> None:
        """Make this forward's detached values the micro-batch's old values, its returns from
        them, and keep each row's values [L-1] (the step's `values`)."""
        old = values_BT.detach().float()
        mb.extras["values"] = old
        mb.extras["returns"] = gae_returns(
            mb.extras["token_rewards"], old, mask, gamma=self.gamma, lam=self.lam
        )
        keep_rows(self.captured, mb, batch_indices, values=old)

    def current_lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.model.optimizer.param_groups[0]["lr"])
