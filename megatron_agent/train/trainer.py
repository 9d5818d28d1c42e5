"""The driver's view of a run: the base model, the tasks, the Ray worker groups, and calls on them.

`Trainer(cfg, plan)` takes a validated config and its plan (`megatron_agent.config`), makes the
base model when needed and loads the tasks (bad data is an error before any worker starts);
`start()` brings up the Megatron world (actor + reference on every rank) and the rollout engines
on the Ray cluster that its owner started (`train/run.py`, or a test's `ray_cluster`). The RL loop
(`rl_loop.py`) then reads as the algorithm: `rollout`, `logprobs`, `train`, `sync`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_agent.config import Config, ConfigError, RunPlan, config_to_dict, make_plan
from megatron_agent.data.sampler import PromptSampler
from megatron_agent.data.tasks import Task, read_task_files
from megatron_agent.envs.tools import merge_tool_metrics
from megatron_agent.rl.kl_controller import make_kl_controller
from megatron_agent.train.cluster import WorkerDiedError, WorkerGroup
from megatron_agent.train.run_log import progress
from megatron_agent.train.update_metrics import combine_replicas

if TYPE_CHECKING:
    from megatron_agent.train.batch import RLBatch

logger = logging.getLogger("megatron_agent.train")


def make_base_model(cfg: Config, plan: RunPlan) -> str:
    """The HF folder the run starts from: `model.path`, or a tiny model made once at
    `plan.model_path` (`<run_dir>/base_model`) when it is empty; its layout is checked."""
    out = Path(plan.model_path)
    if plan.tiny_family and not (out / "config.json").is_file():
        from megatron_agent.train.tiny_cache import make_tiny_base_model

        make_tiny_base_model(plan.tiny_family, cfg.trainer.seed, out)
    check_layout(cfg, plan.model_path)
    return plan.model_path


def check_layout(cfg: Config, model_path: str) -> None:
    """Errors for a parallel layout the model at `model_path` cannot be split into (heads, layers)."""
    from megatron_agent.config.plan import critic_layout
    from megatron_agent.models.hf_config import arch_from_hf_config, check_parallel_fit, load_hf_config

    p = cfg.parallel
    arch = arch_from_hf_config(load_hf_config(model_path))
    check_parallel_fit(arch, p.tp, p.pp, p.vpp, keys=("parallel.tp", "parallel.pp", "parallel.vpp"))
    layout = critic_layout(cfg)  # a separate critic's own layout
    if layout:
        check_parallel_fit(arch, *layout[:3], keys=("critic.tp", "critic.pp", "critic.vpp"))


def kl_controller(cfg: Config):
    """The controller of the KL-in-reward coefficient (`algorithm.kl_*`; saved in run checkpoints)."""
    a = cfg.algorithm
    return make_kl_controller(a.kl_ctrl, a.kl_reward_coef, target_kl=a.kl_target, horizon=a.kl_horizon)


class Trainer:
    """Owns the worker groups and the data of one run."""

    def __init__(self, cfg: Config, plan: RunPlan | None = None, task_files: tuple | None = None):
        """`cfg`: a loaded (validated) config; `plan`: its `make_plan(cfg)` (made here if None);
        `task_files`: what `read_task_files(cfg)` returned (read here if None)."""
        self.cfg = cfg
        self.plan = plan = plan or make_plan(cfg)
        self.run_dir = Path(plan.run_dir)
        # the task files first: a bad one is refused before anything is written to the run folder
        (train_tasks, num_skipped), (val_tasks, num_val_skipped) = task_files or read_task_files(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model_path = make_base_model(cfg, plan)
        from megatron_agent.data.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_path)
        self.train_tasks, self.num_skipped_rows = self._load_tasks(
            cfg.data.train_path, cfg.data.seed, train_tasks, num_skipped
        )
        self.val_tasks, _ = self._load_tasks(
            cfg.data.val_path, cfg.data.seed + 1, val_tasks, num_val_skipped, validation=True
        )
        self.sampler = PromptSampler(len(self.train_tasks), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.kl_ctrl = kl_controller(cfg)
        self.actors: WorkerGroup | None = None
        self.critics: WorkerGroup | None = None  # a critic on ranks of its own (critic.placement=separate)
        self.engines: WorkerGroup | None = None
        self.engine_restarts = 0  # engines replaced in this run (rollout/engine_restarts)
        self.weight_version = 0  # the engines' weight version after the latest sync
        self.actor_version = 1  # the version the actor's weights take at their next sync
        self._engine_reseed: tuple = ()  # the latest reseed, replayed into a replacement engine
        self.replaced: set[int] = set()  # ranks of the engines replaced in this run
        self.engine_activity: list | None = None  # the engines' activity handles (`async.share_cores`)
        self._last_sync: dict = {}  # the latest sync's metrics

    # ----------------------------------------------------------------------------- data
    def _load_tasks(
        self, path: str, seed: int, tasks: list[Task] | None, num_skipped: int, validation: bool = False
    ) -> tuple[list[Task], int]:
        """The tasks read from `path` (`read_task_files`), or synthetic ones when None, without those
        whose prompt exceeds data.max_prompt_length."""
        d = self.cfg.data
        if tasks is None:
            tasks = self._synthetic_tasks(seed, validation)
        kept = [t for t in tasks if self._prompt_length(t) <= d.max_prompt_length]
        num_skipped += len(tasks) - len(kept)
        if len(kept) < len(tasks):
            logger.warning(
                "skipped %d tasks longer than data.max_prompt_length=%d",
                len(tasks) - len(kept),
                d.max_prompt_length,
            )
        if validation and d.val_batch_size:
            kept = kept[: d.val_batch_size]
        if not kept:
            raise ConfigError(
                f"no usable tasks in {path or 'the synthetic set'} ({num_skipped} skipped: bad rows, and "
                f"prompts longer than data.max_prompt_length={d.max_prompt_length})"
            )
        return kept, num_skipped

    def _synthetic_tasks(self, seed: int, validation: bool) -> list[Task]:
        from megatron_agent.data import synthetic

        d = self.cfg.data
        num = d.num_synthetic_val_tasks if validation else d.num_synthetic_tasks
        if d.synthetic == "arithmetic":
            return synthetic.arithmetic_tasks(num, seed=seed, max_depth=d.arithmetic_max_depth)
        # multihop: a corpus, its search index (`plan.search_index_dir`) and questions
        return synthetic.multihop_tasks(self.plan.synthetic_dirs[1 if validation else 0], num, seed)[0]

    def _prompt_length(self, task: Task) -> int:
        """Prompt ids exactly as the agent loop renders them (with the task's tool schemas)."""
        if not hasattr(self, "_chat"):
            from megatron_agent.rollout.chat import ChatFormat
            from megatron_agent.rollout.factory import build_toolset

            toolset = build_toolset(self.cfg, self.plan.tools, self.plan.search_index_dir)
            self._chat, self._toolset = ChatFormat(self.tokenizer), toolset
        return len(self._chat.prompt_ids(task.messages, self._toolset.schemas(task.tools)))

    # ----------------------------------------------------------------------------- workers
    def start(
        self, engines: bool = True, actor_cls: type | None = None, engine_cls: type | None = None
    ) -> dict[str, float]:
        """Start the Megatron world and (unless `engines=False`) the rollout engines on the Ray
        cluster of this process (started by the run's owner), at the same time: the engines build
        vLLM while the ranks join torch.distributed and build their models. `actor_cls`: a
        subclass of `MegatronWorker` for the ranks (tests add their RPCs that way); `engine_cls`:
        a subclass of `RolloutWorker` for the engines (likewise). A critic with ranks of its own
        (`critic.placement=separate`) starts at the same time, in a group of its own.

        Returns the seconds from the start until each kind was ready ({"megatron": s, "engines": s,
        "critic": s});
        a worker that fails to start raises a `WorkerError` naming it (its kind and rank)."""
        import ray

        from megatron_agent.platform.accelerator import cuda_available
        from megatron_agent.rollout.engine_env import engine_process_env
        from megatron_agent.train.cluster import finish_together
        from megatron_agent.train.rollout_worker import RolloutWorker

        cfg = self.cfg
        if not ray.is_initialized():
            raise RuntimeError("Trainer.start() needs a Ray cluster: start it with train.cluster.ray_cluster")
        begin = time.perf_counter()
        cfg_dict, plan_dict = config_to_dict(cfg), self.plan.to_dict()
        on_gpu = cuda_available()
        log_dir = self.run_dir / "logs"
        timeout = cfg.trainer.worker_timeout_s
        if engines:  # first: the engine's start is the longest, and needs nothing of the ranks
            engine_env = engine_process_env()
            if self.plan.mode == "async":
                # The engine core in the engine's process on GPU too: a sync then stops it exactly
                # between two steps (a separate core process runs ahead of the steps we see).
                engine_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            self.engines = WorkerGroup(
                engine_cls or RolloutWorker,
                cfg.rollout.num_engines,
                name="rollout",
                log_dir=log_dir,
                num_cpus=0,
                num_gpus=cfg.rollout.tp if on_gpu and not cfg.rollout.colocate else 0,
                init_args=(cfg_dict, plan_dict),
                timeout_s=timeout,
                env_vars=engine_env,
            )
        # The driver's first torch import (about 1 s, beside the engines' start): the ranks' module
        from megatron_agent.train.megatron_worker import MegatronWorker, rank_threads

        world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
        critic_layout = self.plan.critic_layout
        critic_world = critic_layout[0] * critic_layout[1] * critic_layout[3] if critic_layout else 0
        # Not malloc on huge pages (as the engines): a rank's forward then differed between two
        # processes in 1 of 5 runs (1e-7), which deterministic mode and exact resume cannot have.
        # The cores are shared out among every Megatron rank (a separate critic's too).
        env = {"OMP_NUM_THREADS": str(rank_threads(world + critic_world))}

        def megatron_group(cls, size: int, name: str) -> WorkerGroup:
            return WorkerGroup(
                cls,
                size,
                name=name,
                log_dir=log_dir,
                num_cpus=0 if not on_gpu else 1,
                num_gpus=1 if on_gpu else 0,
                init_args=(cfg_dict, plan_dict),
                timeout_s=timeout,
                env_vars=env if not on_gpu else {},
            )

        self.actors = megatron_group(actor_cls or MegatronWorker, world, "megatron")
        if critic_world:
            from megatron_agent.train.critic_worker import CriticWorker

            self.critics = megatron_group(CriticWorker, critic_world, "critic")
        host, port = self.actors.call("rendezvous_address", ranks=[0])[0]
        calls = {"megatron": self.actors.submit("setup", host, port, cfg.trainer.init_from)}
        if self.critics is not None:  # its own world: its own rendezvous
            host, port = self.critics.call("rendezvous_address", ranks=[0])[0]
            calls["critic"] = self.critics.submit("setup", host, port, cfg.trainer.init_from)
        if engines:
            calls["engines"] = self.engines.submit("ping")  # answered once vLLM is built
        ready = finish_together(calls)
        self.infos = calls["megatron"].result()
        if engines:
            if self.plan.share_cores:
                self.engine_activity = self.engines.call("activity_handle")
            self.actors.call("connect_engines", self.engines.workers, self.engine_activity)
        return {name: at - begin for name, at in ready.items()}

    @property
    def critic_group(self) -> WorkerGroup:
        """The ranks the critic lives on: its own (`critic.placement=separate`) or the actor's."""
        return self.critics if self.critics is not None else self.actors

    def megatron_groups(self) -> list[WorkerGroup]:
        """The Megatron worker groups: the actor's, and a separate critic's."""
        return [g for g in (self.actors, self.critics) if g is not None]

    def on_megatron(self, method: str, *args, **kwargs) -> list:
        """`method(*args)` on every Megatron group at once; the results of each group's call."""
        from megatron_agent.train.cluster import finish_together

        calls = {g.name: g.submit(method, *args, **kwargs) for g in self.megatron_groups()}
        finish_together(calls)
        return [c.result() for c in calls.values()]

    def make_update(self, total_optimizer_steps: int) -> None:
        """Create the PPO update (guard, LR schedule) on every rank (the critic's too)."""
        self.on_megatron("make_update", total_optimizer_steps)

    def restart_from(self, ckpt: str) -> None:
        """Every Megatron rank's models again from `ckpt` (the SFT result), the engines reconnected."""
        self.on_megatron("restart_from", ckpt)
        if self.engines is not None:
            self.actors.call("connect_engines", self.engines.workers, self.engine_activity)

    def load_state(self, ckpt_dir: str) -> None:
        """Every Megatron rank's state from a whole-run checkpoint (`MegatronWorker.load_state`,
        a separate critic's `CriticWorker.load_state`)."""
        self.on_megatron("load_state", ckpt_dir)

    def close(self) -> None:
        """Stop the workers (the Ray cluster stays: its owner stops it)."""
        if self.actors is not None:
            try:  # best effort, briefly: a failed run's ranks may be stuck in a collective
                self.actors.call("close_sync", timeout_s=5.0)
            except Exception:  # noqa: BLE001 - the kill below ends them anyway
                logger.info("could not close the weight sync's shared memory")
        for group in (self.engines, self.critics, self.actors):
            if group is not None:
                group.kill()

    # ----------------------------------------------------------------------------- calls
    def rollout(self, tasks: list[Task], n: int, *, greedy: bool = False) -> list:
        """`n` trajectories per task, tasks split across the engines; task-major order."""
        return self.submit_rollout(tasks, n, greedy=greedy).result()

    def submit_rollout(
        self, tasks: list[Task], n: int, *, greedy: bool = False, reseed=None, pause_after: int | None = None
    ) -> PendingRollout:
        """Start `rollout` on the engines and return at once; `.result()` collects it. `reseed`:
        the `reseed` arguments the engines apply first (an async run's batches carry their own,
        also into an engine that replaces a dead one); `pause_after`: engine steps after which
        each engine's rollout pauses for a weight sync (deterministic async runs)."""
        num = len(self.engines)
        parts = [tasks[i::num] for i in range(num)]
        return PendingRollout(self, tasks, parts, n, greedy, reseed, pause_after)

    def replace_engines(self, dead: list[WorkerDiedError]) -> None:
        """Start a new engine for each dead one (same rank and config), reconnect the actor's
        senders, and sync the actor's weights into every engine, verified, labelled
        `actor_version`: the version the engines had, or the next one when the actor updated
        since (an async run's engine that died while the update ran).

        Raises the death's `WorkerDiedError` when it would exceed `rollout.max_engine_restarts`."""
        limit = self.cfg.rollout.max_engine_restarts
        for exc in dead:
            if self.engine_restarts >= limit:
                raise WorkerDiedError(
                    f"{exc}\nrollout.max_engine_restarts={limit} reached ({self.engine_restarts} engines "
                    "replaced in this run): the run stops. Look for the cause in the log above (memory, "
                    "the node), or raise rollout.max_engine_restarts",
                    exc.rank,
                    exc.pid,
                ) from None
            self.engine_restarts += 1
            logger.warning(
                "rollout engine %d (pid %s) died; starting a new one (restart %d of at most %d); "
                "its prompts are rolled out again:\n%s",
                exc.rank,
                exc.pid if exc.pid is not None else "unknown",
                self.engine_restarts,
                limit,
                exc,
            )
            self.engines.replace(exc.rank)
        ranks = [exc.rank for exc in dead]
        self.engines.call("ping", ranks=ranks)  # the new engines are up (vLLM started)
        if self._engine_reseed:
            self.engines.call("reseed", *self._engine_reseed, ranks=ranks)
        if self.engine_activity is not None:  # only the new engines are asked: the others may be busy
            for rank, handle in zip(ranks, self.engines.call("activity_handle", ranks=ranks)):
                self.engine_activity[rank] = handle
        self.actors.call("connect_engines", self.engines.workers, self.engine_activity)
        self.replaced.update(ranks)
        if self.weight_version > 0:  # else every engine still serves the initial weights
            m = self.sync(force=True)
            logger.warning(
                "rollout engines %s: weights version %d synced (sync/verified=%d, probe max abs diff "
                "%.2e) in %.1f s",
                ranks,
                self.weight_version,
                m["sync/verified"],
                m["sync/probe_max_abs"],
                m["sync/seconds"],
            )

    def reseed_engines(self, *args) -> None:
        """`reseed(*args)` on every engine; remembered, so that a replacement engine gets it too."""
        self._engine_reseed = args
        self.engines.call("reseed", *args)

    def replace_dead_engines(self) -> None:
        """Ping every engine and replace the dead ones (`replace_engines`): an async run checks
        before each sync, which would otherwise fail on an engine that died generating ahead."""
        dead = []
        for rank in range(len(self.engines)):
            try:
                self.engines.call("ping", ranks=[rank])
            except WorkerDiedError as exc:
                dead.append(exc)
        if dead:
            self.replace_engines(dead)

    def tool_metrics(self) -> dict[str, float]:
        """Sandbox metrics of the engines' tools (`merge_tool_metrics`)."""
        return merge_tool_metrics(self.engines.call("tool_metrics"))

    def logprobs(self, batch: RLBatch) -> tuple[dict[str, list], dict[str, float]]:
        """Forward-only passes before the update: `old_logp` and `entropy` (actor) unless the
        update provides them (`RunPlan.old_logprobs_from_update`), and `ref_logp` when a KL needs
        it. Returns ({tensor name: per-sequence rows}, timings); the batch is not changed."""
        with_old, with_ref = not self.plan.old_logprobs_from_update, self.plan.uses_reference
        if not (with_old or with_ref):
            return {}, {}
        calls = self.actors.call("logprobs", batch.sequences, with_old, with_ref)
        results = [r for r in calls if r is not None]
        tensors = {
            name: gather_rows(batch, name, [(r["indices"], r[key]) for r in results])
            for key, name in (("old", "old_logp"), ("ref", "ref_logp"), ("entropy", "entropy"))
            if results[0][key] is not None
        }
        names = [
            k for k, wanted in (("timing_s/old_log_prob", with_old), ("timing_s/ref", with_ref)) if wanted
        ]
        return tensors, {k: max(r[k] for r in results) for k in names}

    def submit_values(self, batch: RLBatch) -> CriticCall:
        """Start the critic's values of the batch's sequences before the update; `.result()`:
        (per-sequence rows over the targets, like the log-probs; `timing_s/values`). On a
        separate critic they are computed while the driver goes on (the actor's log-probs)."""

        def finish(results):
            results = [r for r in results if r is not None]
            rows = gather_rows(batch, "values", [(r["indices"], r["values"]) for r in results])
            return rows, {"timing_s/values": max(r["timing_s/values"] for r in results)}

        return CriticCall(self, finish, "values", batch.sequences)

    def submit_train_critic(
        self, batch: RLBatch, mini_batch_indices: list[list[int]], step: int
    ) -> CriticCall:
        """Start the critic's update; `.result()`: (its metrics combined over the replicas by
        update_metrics.py, {"values": rows} when the values came from the update's forward
        (`RunPlan.values_from_update`), else {}). A separate critic trains while the actor's
        update runs."""
        import ray

        def finish(results):
            results = [r for r in results if r is not None]
            captured = [r.pop("captured") for r in results if "captured" in r]
            m = combine_replicas(results)
            if call.waited_s is not None:  # colocated: the wait, as the actor's update is timed
                m["timing_s/update_critic"] = call.waited_s
            if not captured:
                return m, {}
            return m, {
                "values": gather_rows(batch, "values", [(c["indices"], c["values"]) for c in captured])
            }

        start = time.perf_counter()  # the batch's transfer counts, as in the actor's update
        call = CriticCall(self, finish, "train_critic", ray.put(batch), mini_batch_indices, step, start=start)
        return call

    def train(
        self, batch: RLBatch, mini_batch_indices: list[list[int]], step: int
    ) -> tuple[dict[str, float], dict[str, list]]:
        """The PPO update. Returns (its metrics combined over the data-parallel replicas by the
        table of `update_metrics.py`, {tensor name: rows} of the old log-probs and entropy when
        they came from the update's forward, else {})."""
        import ray

        ref = ray.put(batch)  # one copy in the object store, read by every rank
        num_updates = len(mini_batch_indices) * self.cfg.actor.ppo_epochs
        with progress("update", total=num_updates, enabled=self.cfg.logging.progress_bars, unit="opt") as bar:
            results = [r for r in self.actors.call("train", ref, mini_batch_indices, step) if r is not None]
            bar.update(num_updates)
        captured = [r.pop("captured") for r in results if "captured" in r]
        tensors = {
            name: gather_rows(batch, name, [(c["indices"], c[key]) for c in captured])
            for key, name in (("old", "old_logp"), ("entropy", "entropy"))
            if captured
        }
        self.actor_version = self.weight_version + 1  # what this update makes, at its sync
        return combine_replicas(results), tensors

    def sync(self, force: bool = False) -> dict[str, float]:
        """Push the actor's weights into every engine, verified (collective over the Megatron
        world); the engines then hold them labelled `actor_version`. When they hold them already
        (an engine replaced since the update synced every engine), the metrics of that sync,
        unless `force`."""
        if self.weight_version == self.actor_version and self._last_sync and not force:
            return dict(self._last_sync)
        metrics = self.actors.call("sync_weights", self.actor_version)[0]
        self.weight_version = int(metrics["sync/weight_version"])
        if self.weight_version != self.actor_version:
            raise RuntimeError(
                f"the sync left the engines at version {self.weight_version}, not {self.actor_version}"
            )
        self._last_sync = metrics
        return metrics


class CriticCall:
    """A call on the critic's ranks. On the actor's ranks (colocated) it runs at once: the actor's
    next call would wait behind it anyway, and its timing would include it. On ranks of its own
    it runs while the driver goes on; `result()` waits for it."""

    def __init__(self, trainer: Trainer, finish, method: str, *args, start: float | None = None):
        """`finish(results)` makes the product of the workers' results; `start`: when the call
        began for its timing (default: now)."""
        self.finish = finish
        start = time.perf_counter() if start is None else start
        self.call = trainer.critic_group.submit(method, *args)
        self.results = self.waited_s = None
        if trainer.critics is None:
            self.results = self.call.result()
            self.waited_s = time.perf_counter() - start  # the driver's wait (colocated only)

    def result(self):
        """The finished call's product (its workers' failures raise `WorkerError`)."""
        if self.results is None:
            self.results = self.call.result()
        return self.finish(self.results)


class PendingRollout:
    """A rollout submitted to the engines (`Trainer.submit_rollout`).

    An engine whose process dies meanwhile is replaced (`Trainer.replace_engines`) and its whole
    share is rolled out again on the new one (its partial trajectories are lost with it). In an
    async run later rollouts were queued on the dead engine too: they find it replaced already
    and resubmit to the new one, with their own `reseed` (the seeds of their step)."""

    def __init__(
        self,
        trainer: Trainer,
        tasks: list[Task],
        parts: list[list[Task]],
        n: int,
        greedy: bool,
        reseed=None,
        pause_after: int | None = None,
    ):
        self.trainer, self.tasks, self.parts, self.n, self.greedy = trainer, tasks, parts, n, greedy
        self.options = {"reseed": reseed, "pause_after": pause_after} if reseed or pause_after else {}
        self.pending = {i: (parts[i], n, greedy) for i in range(len(parts)) if parts[i]}
        self.calls = self._submit()

    def _submit(self) -> dict:
        engines, calls = self.trainer.engines, {}
        self.handles = {rank: engines.workers[rank] for rank in self.pending}
        for rank, args in self.pending.items():
            options = dict(self.options)
            if rank in self.trainer.replaced:  # a new engine takes syncs as they come: no pause
                options.pop("pause_after", None)  # (it may run a newer batch first)
            calls[rank] = engines.submit("start_rollout", *args, ranks=[rank], **options)
        return calls

    def _collect(self, rank: int, started) -> list:
        """Rank's trajectories, collected from the engine that started them."""
        rollout_id = started.result()[0]
        engines = self.trainer.engines
        if engines.workers[rank] is not self.handles[rank]:  # replaced since: its rollouts died with it
            raise WorkerDiedError(f"rollout engine {rank} was replaced while it rolled out", rank)
        return engines.call("collect", rollout_id, ranks=[rank])[0]

    def result(self) -> list:
        """The trajectories, task-major (waits for the engines)."""
        results: dict[int, list] = {}
        bars = self.trainer.cfg.logging.progress_bars
        with progress("rollout", total=len(self.tasks) * self.n, enabled=bars, unit="traj") as bar:
            while self.pending:
                dead = []
                for rank, call in self.calls.items():  # started together; collected one by one
                    try:
                        results[rank] = self._collect(rank, call)
                        bar.update(len(results[rank]))
                    except WorkerDiedError as exc:  # an exception raised inside it stays an error
                        dead.append(exc)
                current = self.trainer.engines.workers
                still_there = [exc for exc in dead if current[exc.rank] is self.handles[exc.rank]]
                if still_there:  # else replaced already, for an earlier rollout queued on it
                    self.trainer.replace_engines(still_there)
                self.pending = {exc.rank: self.pending[exc.rank] for exc in dead}
                self.calls = self._submit() if self.pending else {}
        by_task = {}
        for rank, trajs in sorted(results.items()):
            for k, task in enumerate(self.parts[rank]):
                by_task.setdefault(id(task), []).append(trajs[k * self.n : (k + 1) * self.n])
        out = []
        for task in self.tasks:
            out.extend(by_task[id(task)].pop(0))
        return out


def gather_rows(batch: RLBatch, name: str, parts: list[tuple[list[int], list]]) -> list:
    """One tensor per sequence of `batch` from the replicas' (indices, per-sequence rows) pairs
    (`batch.host_row` arrays, or tensors); every sequence must be covered."""
    import numpy as np
    import torch

    rows: list = [None] * len(batch)
    for indices, tensors in parts:
        for i, t in zip(indices, tensors):
            rows[i] = torch.from_numpy(t.copy()) if isinstance(t, np.ndarray) else t  # Ray's are read-only
    missing = [batch.uids[i] for i, r in enumerate(rows) if r is None]
    if missing:
        raise RuntimeError(f"no {name} came back for {len(missing)} sequences (first: {missing[0]})")
    return rows
