"""One rank of a critic on ranks of its own (`critic.placement=separate`) as a Ray actor.

The driver makes `tp * pp * dp` of these (`RunPlan.critic_layout`) beside the actor's Megatron
ranks: a worker group with its own torch.distributed world and model-parallel groups, so the
critic may take another layout than the actor's, and its value pass and update run while the
actor's log-prob pass and update run. The driver calls every method on the whole group at once,
like the actor's (`train/megatron_worker.py`); results come from the reporting ranks.

A whole-run checkpoint is written by both groups: the critic's ranks write its folder into a
staging folder next to the checkpoint (`save_critic`), the actor's ranks move it in before the
manifest is written (`MegatronWorker.save_state`), so the checkpoint stays atomic and has the
colocated critic's format (either placement resumes from it).
"""

from __future__ import annotations

from pathlib import Path

from megatron_agent.train.critic_role import CriticRole
from megatron_agent.train.megatron_worker import MegatronRank, build_options


class CriticWorker(MegatronRank, CriticRole):
    """A rank of the critic's own Megatron world."""

    def setup(self, master_addr: str, master_port: int, init_from: str = "") -> dict:
        """Join the critic's world at its layout and build the critic: from the run's model (a new
        value head), with the transformer of `init_from` (an SFT checkpoint) when given, or from
        `critic.init_from`. Returns this rank's parallel info."""
        from megatron_agent.train.actor_update import parallel_info

        layout = self.plan.critic_layout
        self._join_world(master_addr, master_port, layout)
        self.critic = self._new_critic(build_options(self.cfg, layout))
        if init_from:
            self._load_critic_transformer(init_from)
        self._load_critic_init()
        self.info = parallel_info()
        return {"rank": self.rank, "dp_rank": self.info.dp_rank, "dp_size": self.info.dp_size}

    def make_update(self, total_optimizer_steps: int) -> None:
        """Create the critic's update (its guard and LR schedule span the whole run)."""
        self._make_critic_update()

    def restart_from(self, ckpt_dir: str) -> None:
        """The critic built again (fresh optimizer) on the transformer of `ckpt_dir` (after SFT)."""
        self.critic = self._new_critic(self.critic.opts)
        self._load_critic_transformer(ckpt_dir)
        self._load_critic_init()

    def save_critic(self, folder: str) -> str:
        """Collective: the critic's part of a whole-run checkpoint into `folder` (made here; it
        must not exist). On a failure every rank raises and rank 0 removes the folder."""
        from megatron_agent.checkpoint.model_io import (
            discard_on_error,
            keep_write_results_in_process,
            on_rank0,
        )

        path = Path(folder)

        def make():
            for sub in ("model", "optim"):
                (path / sub).mkdir(parents=True)

        keep_write_results_in_process()
        with self._recording_save_error(folder):
            on_rank0(make)
            with discard_on_error(path):
                self._write_critic(path)
        return folder

    def load_state(self, ckpt_dir: str) -> None:
        """Collective: the critic of a whole-run checkpoint (weights, optimizer, schedule, guard;
        written at any layout and by either placement). `make_update` must have run."""
        self._load_critic_state(ckpt_dir)

    def close_sync(self) -> None:
        """Nothing to free: the critic sends no weights."""
