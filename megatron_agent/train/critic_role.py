"""The critic's part of a Megatron rank: its build, value pass, update and checkpoint folder.

A critic (`algorithm.adv_estimator=gae`) lives in one of two homes, and both mix `CriticRole`
in: `MegatronWorker` (`critic.placement=colocated`: on the actor's ranks, at their layout) and
`CriticWorker` (`separate`: ranks of its own with their own torch.distributed world and layout,
train/critic_worker.py). The role needs the rank's `cfg`, `plan`, `rank`, `model_path` and, once
the world is joined, `info` (`actor_update.parallel_info`).

A whole-run checkpoint holds the critic in `critic/`: `model` and `optim` (dist checkpoints,
loadable at any layout, so a run may resume with the other placement or another critic layout)
and `update.pt` (its LR schedule, optimizer-step count and guard).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from megatron_agent.config import Config

CRITIC_DIR = "critic"
"""The critic's folder inside a whole-run checkpoint."""


def critic_optimizer_config(cfg: Config):
    """The critic's `OptimConfig` (the `critic` section; sharding as the actor's)."""
    from megatron_agent.models.policy import OptimConfig

    c = cfg.critic
    return OptimConfig(
        lr=c.lr,
        weight_decay=c.weight_decay,
        grad_clip=c.grad_clip,
        use_distributed_optimizer=cfg.actor.use_distributed_optimizer,
    )


def critic_update(cfg: Config, model, total_optimizer_steps: int, *, console: bool, values_from_update: bool):
    """The critic's update: its own guard (reports under `<run_dir>/critic/guard`), its LR schedule
    over the same optimizer steps as the actor's; `values_from_update`: `RunPlan.values_from_update`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_agent.rl import StepGuard
    from megatron_agent.train.critic_update import CriticUpdate
    from megatron_agent.train.megatron_worker import scheduler_options

    options = scheduler_options(cfg, total_optimizer_steps, "critic")
    for group in model.optimizer.param_groups:  # as for the actor (MegatronWorker.make_update)
        group["max_lr"], group["min_lr"] = options["max_lr"], options["min_lr"]
    guard = StepGuard.from_config(cfg.algorithm, Path(cfg.trainer.run_dir) / CRITIC_DIR)
    guard.console = console
    scheduler = OptimizerParamScheduler(model.optimizer, **options)
    algo = cfg.algorithm
    return CriticUpdate(
        model,
        cfg.critic,
        guard,
        scheduler,
        micro_batch_tokens=cfg.actor.micro_batch_tokens,
        values_from_update=values_from_update,
        gamma=algo.gamma,
        lam=algo.lam if algo.lam_critic is None else algo.lam_critic,
    )


class CriticRole:
    """The critic's methods of a Megatron rank (mixed into `MegatronWorker` and `CriticWorker`)."""

    critic = None  # the value model (`MegatronModel(head="values")`), once built
    critic_update = None  # its `CriticUpdate`, once `_make_critic_update` ran

    # ------------------------------------------------------------------------------ build
    def _new_critic(self, opts):
        """The critic from `self.model_path` (a new value head, seeded by `trainer.seed`) with a
        fresh optimizer (the `critic` section), built at `opts` (its layout)."""
        from megatron_agent.build_policy import critic_from_hf

        return critic_from_hf(
            self.model_path, opts, optim=critic_optimizer_config(self.cfg), seed=self.cfg.trainer.seed
        )

    def _load_critic_transformer(self, ckpt_dir: str) -> None:
        """The transformer of an actor's checkpoint (e.g. SFT's) into the critic; its own head stays."""
        from megatron_agent.checkpoint.model_io import load_checkpoint
        from megatron_agent.models.value_model import HEAD_PREFIX

        # sizes only: the driver hashed every file before any worker started
        load_checkpoint(ckpt_dir, self.critic.chunks, self.critic.arch, verify=False, skip_prefix=HEAD_PREFIX)

    def _load_critic_init(self) -> None:
        """The critic of `critic.init_from` (weights and head) over the one just built."""
        if self.critic is not None and self.plan.critic_init_from:
            from megatron_agent.checkpoint.model_io import load_checkpoint

            load_checkpoint(
                self.plan.critic_init_from,
                self.critic.chunks,
                self.critic.arch,
                verify=False,
                model_dir=f"{CRITIC_DIR}/model",
            )

    def _make_critic_update(self) -> None:
        """The critic's update for the whole run (its schedule spans every optimizer step)."""
        steps = self.cfg.trainer.total_steps * self.cfg.critic.ppo_epochs * self.plan.num_mini_batches
        self.critic_update = critic_update(
            self.cfg,
            self.critic,
            steps,
            console=self.rank == 0,
            values_from_update=self.plan.values_from_update,
        )

    # ------------------------------------------------------------------------------ RL
    def values(self, sequences: list[list[int]]) -> dict | None:
        """The critic's values of this replica's share (before the update), and their timing."""
        from megatron_agent.train.actor_update import shard_logprobs

        start = time.perf_counter()  # a value model's forward gives its values (MegatronModel.forward_only)
        indices, values, _ = shard_logprobs(
            self.critic, sequences, micro_batch_tokens=self.cfg.actor.micro_batch_tokens, with_entropy=False
        )
        if not self.info.reports:
            return None
        return {"indices": indices, "values": values, "timing_s/values": time.perf_counter() - start}

    def train_critic(self, batch, mini_batch_indices: list[list[int]], step: int) -> dict | None:
        """The critic's update of one RL step; metric sums (and its wall time) on reporting ranks,
        None elsewhere. With values from the update, `captured`: this replica's values."""
        start = time.perf_counter()
        sums = self.critic_update.run(batch, mini_batch_indices)
        sums["critic/lr"] = self.critic_update.current_lr()
        sums["timing_s/update_critic"] = time.perf_counter() - start
        if self.critic_update.values_from_update:
            sums["captured"] = self.critic_update.captured
        return sums if self.info.reports else None

    # ------------------------------------------------------------------------------ run state
    def _write_critic(self, folder: Path) -> None:
        """Collective over the critic's world: its weights, optimizer, schedule and guard into
        `folder` (whose `model` and `optim` sub-folders exist, empty)."""
        from megatron.core import dist_checkpointing

        from megatron_agent.checkpoint.model_io import model_sharded_state_dict
        from megatron_agent.train.worker_state import save_optimizer, trainer_state

        dist_checkpointing.save(model_sharded_state_dict(self.critic.chunks), str(folder / "model"))
        save_optimizer(self.critic, folder / "optim")
        if self.rank == 0:
            torch.save(trainer_state(self.critic_update), folder / "update.pt")

    def _load_critic_state(self, ckpt_dir: str) -> None:
        """Collective over the critic's world: what `_write_critic` wrote into `ckpt_dir`'s critic
        folder (at any layout); the update (`_make_critic_update`) must exist."""
        from megatron_agent.checkpoint.model_io import load_checkpoint
        from megatron_agent.train.worker_state import load_optimizer, load_trainer_state

        folder = Path(ckpt_dir) / CRITIC_DIR
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{ckpt_dir} holds no critic: it was saved by a run without algorithm.adv_estimator=gae"
            )
        load_checkpoint(
            ckpt_dir, self.critic.chunks, self.critic.arch, verify=False, model_dir=f"{CRITIC_DIR}/model"
        )
        load_optimizer(self.critic, folder / "optim")
        load_trainer_state(self.critic_update, torch.load(folder / "update.pt", weights_only=False))
