"""Asynchronous rollouts: the engines generate the next steps' groups while the actor trains.

Staleness is bounded by admission, not by discarding. Before step k the trainer has made
u = k - 1 updates; a batch of `data.train_batch_size` groups is admitted (its prompts drawn
from the sampler, its generation submitted to the engines) only while fewer than
(eta + 1) x `data.train_batch_size` groups are ahead of the trainer, i.e. while

    admitted batches < u + eta + 1            (eta = `async.max_staleness`)

so the batch trained at update k was sampled by weights at least version k - eta (the engines
hold version u + 1 after u updates and the first sync). Groups are trained whole, in admission
order: the prompt order is the sampler's, as in a synchronous run. Each batch's rollout carries
its own seeds (`reseed`).

The syncs do not wait for the engines: a sync interrupts the rollouts in flight between two
engine steps, the new weights go in, and the interrupted requests continue under them
(train/rollout_worker.py), so a trajectory can span versions and every token records its own.
With eta = 0 nothing is in flight at a sync: the calls are exactly those of the synchronous run.
In deterministic mode the point of each interruption is fixed by the config: sync u (after
update u - 1) interrupts batch u - 1 + eta, which pauses for it after
`async.interrupt_after_engine_steps` engine steps of its rollout (`sync_points`).

A checkpoint keeps the admitted, not yet trained batches with their trajectories
(`state_dict`), so a resumed run trains exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from megatron_agent.envs.tools import merge_tool_metrics
from megatron_agent.rollout.trajectory import Trajectory
from megatron_agent.train.cluster import WorkerDiedError
from megatron_agent.train.run_state import rollout_seed


@dataclass
class AdmittedBatch:
    """One admitted batch: its step, its prompts, and its rollout (a future until collected)."""

    step: int
    """The RL step that trains it."""
    indices: list[int]
    """Its prompts: indices into the training tasks, in the sampler's order."""
    pending: object = None
    """The submitted rollout (`PendingRollout`), None once collected or restored."""
    trajectories: list[Trajectory] | None = None
    """The collected trajectories, task-major."""
    engine_metrics: dict = field(default_factory=dict)
    """tool/* and the engines' idle time before this batch."""


class RolloutPipeline:
    """The admitted batches ahead of the trainer (`trainer.mode=async`)."""

    def __init__(self, trainer, max_staleness: int):
        self.t, self.eta = trainer, max_staleness
        self.batches: deque[AdmittedBatch] = deque()
        self.admitted = 0  # batches admitted in the run so far (the last one's step)
        cfg = trainer.cfg
        self.fixed_points = cfg.trainer.deterministic and max_staleness >= 1
        self.pause_steps = cfg.async_.interrupt_after_engine_steps

    # ----------------------------------------------------------------------------- admission
    def admit(self, updates_done: int, last_step: int) -> None:
        """Admit every batch the bound allows after `updates_done` updates (none past `last_step`)."""
        while self.admitted < min(updates_done + self.eta + 1, last_step):
            self._submit(self.admitted + 1)

    def _submit(self, step: int) -> None:
        cfg, t = self.t.cfg, self.t
        indices = t.sampler.next_batch(cfg.data.train_batch_size)
        reseed = (rollout_seed(cfg.rollout.seed, step), step)
        # Batch b is the one that sync b + 1 - eta interrupts (when b > eta): in deterministic
        # mode its rollout pauses for it at a fixed engine step.
        pause = self.pause_steps if self.fixed_points and step > self.eta else None
        tasks = [t.train_tasks[i] for i in indices]
        pending = t.submit_rollout(tasks, cfg.rollout.n, reseed=reseed, pause_after=pause)
        self.batches.append(AdmittedBatch(step, indices, pending))
        self.admitted = step

    def before_sync(self, step: int) -> None:
        """Before the sync after update `step`: replace the engines that died generating ahead (a
        replacement syncs the new weights into every engine), and name the sync's point."""
        self.t.replace_dead_engines()
        if self.t.weight_version != self.t.actor_version:  # else a replacement synced them already
            self.sync_points(step)

    def sync_points(self, step: int) -> None:
        """Before the sync after update `step` (deterministic mode, eta >= 1): tell every engine
        where it applies. It interrupts batch step + eta, which pauses for it; past the last step,
        it waits for the last batch to end. Engines replaced in this run take it at once."""
        if not self.fixed_points:
            return
        cfg, t = self.t.cfg, self.t
        target, total = step + self.eta, cfg.trainer.total_steps
        point = (target, True) if target <= total else (total, False)
        ranks = [r for r in range(min(cfg.data.train_batch_size, len(t.engines))) if r not in t.replaced]
        if ranks:  # an engine with no share of the batches runs no rollout a sync could meet
            t.engines.call("sync_point", *point, ranks=ranks)

    # ----------------------------------------------------------------------------- the stage
    def rollouts(self, step: int, m: dict):
        """The rollout stage of async step `step` (`rl_loop.Rollouts`): admit what the bound
        allows, then take this step's batch (generated meanwhile). Adds the engines' tool
        metrics, `async/admitted_groups`, `async/interrupted_requests`, `timing_s/wait_rollout`
        (the trainer idle) and `timing_s/wait_update` (the engines idle) to `m`."""
        from megatron_agent.train.rl_loop import Rollouts

        cfg, t = self.t.cfg, self.t
        self.admit(updates_done=step - 1, last_step=cfg.trainer.total_steps)
        admitted, waited = self.take(step)
        m.update(admitted.engine_metrics)
        m["timing_s/wait_rollout"] = waited
        m["async/admitted_groups"] = float(self.admitted * cfg.data.train_batch_size)
        m["async/interrupted_requests"] = float(interrupted_requests(admitted.trajectories))
        m["rollout/gen_batches"], m["rollout/dropped_groups"] = 1.0, 0.0
        n, kept, group_ids, tasks = cfg.rollout.n, admitted.trajectories, [], {}
        for k, index in enumerate(admitted.indices):
            group = kept[k * n : (k + 1) * n]
            group_id = f"0:{k}:{group[0].task_uid}"  # as a synchronous step's first round names it
            group_ids.extend([group_id] * len(group))
            tasks[group_id] = t.train_tasks[index]
        return Rollouts(kept, group_ids, tasks)

    # ----------------------------------------------------------------------------- collection
    def take(self, step: int) -> tuple[AdmittedBatch, float]:
        """The batch trained at `step` and the seconds the trainer waited for it."""
        start = time.perf_counter()
        batch = self.batches.popleft()
        if batch.step != step:
            raise RuntimeError(f"async rollouts: step {step} got the batch admitted for step {batch.step}")
        self._collect(batch)
        return batch, time.perf_counter() - start

    def drain(self) -> float:
        """Wait for every admitted batch (before a checkpoint); returns the seconds waited."""
        start = time.perf_counter()
        for batch in self.batches:
            self._collect(batch)
        return time.perf_counter() - start

    def _collect(self, batch: AdmittedBatch) -> None:
        """Wait for the batch's rollout; then the engines' tool metrics and idle time since the
        previous collection."""
        if batch.trajectories is not None:
            return
        batch.trajectories = batch.pending.result()
        engines, tools, idle = self.t.engines, [], []
        for rank in range(len(engines)):
            try:
                tools += engines.call("tool_metrics", ranks=[rank])
                idle += engines.call("idle_seconds", ranks=[rank])
            except WorkerDiedError:  # died after its share: replaced at the next rollout or sync
                pass
        merged = merge_tool_metrics(tools)
        merged["timing_s/wait_update"] = sum(idle) / max(len(idle), 1)
        batch.engine_metrics, batch.pending = merged, None

    # ----------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """The admission count and the admitted batches with their trajectories (waits for them)."""
        self.drain()
        return {
            "admitted": self.admitted,
            "max_staleness": self.eta,
            "batches": [
                {
                    "step": b.step,
                    "indices": b.indices,
                    "trajectories": [tr.to_state() for tr in b.trajectories],
                    "engine_metrics": b.engine_metrics,
                }
                for b in self.batches
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved (the sampler is restored with the driver's state)."""
        self.admitted = int(state["admitted"])
        self.batches = deque(
            AdmittedBatch(
                b["step"],
                list(b["indices"]),
                trajectories=[Trajectory.from_state(tr) for tr in b["trajectories"]],
                engine_metrics=dict(b["engine_metrics"]),
            )
            for b in state["batches"]
        )


def interrupted_requests(trajectories) -> int:
    """Requests (assistant turns) whose tokens more than one weight version sampled: a sync
    interrupted them while they generated."""
    return sum(
        len(set(tr.token_versions[start:end])) > 1 for tr in trajectories for start, end in tr.turn_spans
    )
