"""`Run`: the owner of one training run, from its start to its exit status.

A run owns, in this order: the Ray cluster (`ray_cluster`, one owner, stopped at exit), the
stop signals, the workers (`Trainer`), the start (fresh, an SFT warm start, or a resume from
the newest checkpoint), the step loop, and its components, each of which decides when it acts:
the `Validator` (before the first step, every `trainer.test_freq` steps, after the last) and the
`Saver` (`train/checkpointer.py`: every `checkpoint.save_freq` steps and at the end).
`commands/train.py` and `commands/sft.py` only parse arguments and return `Run`'s exit status:
0 (done, or stopped by a signal after saving), 1 (a worker or a save failed), 2 (bad input).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from megatron_agent.config import Config, ConfigError, make_plan

logger = logging.getLogger("megatron_agent.train")

BAD_INPUT = (ConfigError, ValueError, FileNotFoundError)


class Validator:
    """Greedy validation on its cadence: before the first step, every `trainer.test_freq` steps
    and after the last one."""

    def __init__(self, cfg: Config, trainer):
        self.trainer, self.freq, self.last = trainer, cfg.trainer.test_freq, cfg.trainer.total_steps

    def due(self, step: int) -> bool:
        """True when validation runs after `step` (step 0: before the first step)."""
        return step in (0, self.last) or bool(self.freq and step % self.freq == 0)

    def __call__(self) -> dict[str, float]:
        """The validation metrics (`val/*`)."""
        return validate(self.trainer)


def validate(t) -> dict[str, float]:
    """Greedy rollouts of the validation tasks by the trainer `t`: val/score/mean and val/accuracy."""
    start = time.perf_counter()
    trajectories = t.rollout(t.val_tasks, 1, greedy=True)
    rewards = [tr.reward or 0.0 for tr in trajectories]
    return {
        "val/score/mean": sum(rewards) / len(rewards),
        "val/accuracy": sum(is_correct(tr) for tr in trajectories) / len(trajectories),
        "val/tool_calls_per_sample": sum(len(tr.tool_calls) for tr in trajectories) / len(trajectories),
        "timing_s/testing": time.perf_counter() - start,
    }


def is_correct(trajectory) -> bool:
    """True when the task's correctness reward (numeric, exact match or F1) is full."""
    info = trajectory.reward_info or {}
    scores = [v for k, v in info.items() if k in ("numeric", "exact_match", "f1")]
    return bool(scores) and max(scores) >= 1.0 - 1e-9


class Run:
    """One run of `train` (RL, after an optional SFT warm start) or of `sft` alone."""

    def __init__(self, cfg: Config):
        """`cfg`: a loaded config (`load_config` validated it); its plan is made here, once."""
        from megatron_agent.train.startup import StartupClock

        self.cfg = cfg
        self.plan = make_plan(cfg)
        self.startup = StartupClock()  # timing_s/startup/*: what the start-up spent its time on
        self.memory = None  # the process tree's memory sampler while workers run (_with_workers)
        self.ray_start = None  # Ray's start, begun once the inputs are checked (`_trainer`)
        self.first_step_at: float | None = None  # seconds from the process's start to the first step

    # ----------------------------------------------------------------------------- entry points
    def train(self) -> int:
        """The RL run (resumed when a checkpoint says so); returns the exit status."""
        from megatron_agent.train.run_state import find_resume, resolve_ref_from, set_aside_before_writing
        from megatron_agent.train.signals import StopRequest

        inputs_start = time.perf_counter()
        try:  # first: a run folder whose checkpoints all fail is refused before anything is written
            resume_dir, state = find_resume(self.cfg)
        except BAD_INPUT as exc:
            return _error(exc, 2)
        total = self.cfg.trainer.total_steps
        if state is not None and state["step"] >= total:
            print(
                f"the run is already finished: {resume_dir} is at step {state['step']} of "
                f"trainer.total_steps={total}; nothing to do (raise trainer.total_steps to go on)"
            )
            return 0
        trainer = self._trainer(sft=self._sft_runs())
        if trainer is None:
            return 2
        self.startup.add("inputs", time.perf_counter() - inputs_start)
        try:
            if state is not None and state.get("ref_from"):  # stored relative to the run folder
                state["ref_from"] = str(resolve_ref_from(state["ref_from"], trainer.run_dir, resume_dir))
            pipeline = async_pipeline(trainer, state)
            if not _versions_ok():
                self.ray_start.cancel()
                return 2
            # what this run would write over is moved aside, never overwritten
            set_aside_before_writing(
                self.cfg, None if state is None else state["step"], sft_runs=self._sft_runs()
            )
        except BaseException as exc:
            self.ray_start.cancel()  # begun in `_trainer`: stopped, not left running
            if isinstance(exc, BAD_INPUT):
                return _error(exc, 2)
            raise
        with StopRequest() as stop:
            return self._with_workers(
                trainer, stop, lambda log: self._rl(trainer, log, stop, resume_dir, state, pipeline)
            )

    def sft(self) -> int:
        """SFT alone (`sft` command): the checkpoint that `train` starts from with `trainer.init_from`."""
        from megatron_agent.train.run_state import set_aside
        from megatron_agent.train.sft_run import run_sft

        trainer = self._trainer(sft=True)
        if trainer is None:
            return 2
        previous = trainer.run_dir / "sft" / "checkpoint"
        if previous.exists():  # never written over
            set_aside(previous, "previous")

        def body(run_log) -> int:
            ckpt = run_sft(trainer, run_log, trainer.run_dir / "sft" / "checkpoint")
            print(f"SFT checkpoint: {ckpt}\nstart RL from it with: trainer.init_from={ckpt}")
            return 0

        return self._with_workers(trainer, None, body, engines=False)

    def _sft_runs(self) -> bool:
        """True when `train` starts with SFT (sft.steps > 0 and no trainer.init_from)."""
        return self.cfg.sft.steps > 0 and not self.cfg.trainer.init_from

    # ----------------------------------------------------------------------------- lifetime
    def _trainer(self, *, sft: bool):
        """The driver's `Trainer` (tasks loaded, base model made), after the inputs that only the
        workers would read are checked: all before Ray or any worker starts. None: bad input."""
        from megatron_agent.data.tasks import read_task_files
        from megatron_agent.train.cluster import RayStart

        try:
            check_inputs_up_front(self.cfg, sft=sft)
            task_files = read_task_files(self.cfg)
        except BAD_INPUT as exc:
            _error(exc, 2)
            return None
        # Ray starts in the background while the driver imports torch and makes its base model,
        # tokenizer and tasks (nothing before this point imports torch: 1 s sooner)
        self.ray_start = RayStart(self.cfg.ray.address, self.cfg.ray.num_cpus).begin()
        try:
            from megatron_agent.train.trainer import Trainer

            return Trainer(self.cfg, self.plan, task_files)
        except BAD_INPUT as exc:
            self.ray_start.cancel()
            _error(exc, 2)
            return None

    def _with_workers(self, trainer, stop, body, *, engines: bool = True) -> int:
        """Ray, then the signal handlers, then the workers; `body(run_log)` in between; everything
        closed in reverse order whatever happens."""
        import ray

        from megatron_agent.config import config_to_dict
        from megatron_agent.config.validate import check_cluster_gpus
        from megatron_agent.platform.tree_memory import TreeMemory
        from megatron_agent.train.checkpointer import SaveError
        from megatron_agent.train.cluster import WorkerError, ray_cluster
        from megatron_agent.train.run_log import RunLogger

        cfg = self.cfg
        run_log = RunLogger(trainer.run_dir, cfg.logging, config_dict=config_to_dict(cfg))
        self.memory = TreeMemory().start()
        wait_start = time.perf_counter()
        try:
            # ray.init installs Ray's own SIGTERM handler (a crash report): Ray first, then ours.
            with ray_cluster(cfg.ray.address, cfg.ray.num_cpus, begun=self.ray_start):
                self.startup.add("wait_ray", time.perf_counter() - wait_start)
                if self.ray_start is not None:
                    self.startup.add("ray", self.ray_start.seconds)
                if cfg.ray.address:  # a joined cluster: GPU-only settings need its GPUs
                    check_cluster_gpus(cfg, ray.cluster_resources().get("GPU", 0))
                if stop is not None:
                    stop.install()
                try:
                    with self.startup.phase("workers"):
                        for kind, seconds in trainer.start(engines=engines).items():
                            self.startup.add(kind, seconds)
                    return body(run_log)
                finally:
                    trainer.close()
        except ConfigError as exc:
            return _error(exc, 2)
        except (WorkerError, SaveError) as exc:
            return _error(exc, 1)
        finally:
            run_log.close()
            self._report_performance(trainer.run_dir)

    def _started(self) -> dict[str, float]:
        """The start-up is over (the first step begins): its line in the log, its metrics."""
        metrics = self.startup.metrics()
        self.first_step_at = metrics["timing_s/startup/total"]
        logger.info("%s", self.startup.line())
        return metrics

    def _report_performance(self, run_dir: Path) -> None:
        """At exit: the peak memory of the run's process tree, logged and written to perf.json
        with the start-up's phases."""
        import json

        memory = self.memory.stop()
        logger.info(
            "peak memory of the run's processes: %.2f GB resident, summed over %d processes (%.2f GB "
            "with shared pages counted once)",
            memory["perf/peak_rss_sum_gb"],
            memory["perf/peak_processes"],
            memory["perf/peak_pss_sum_gb"],
        )
        perf = {k: v for k, v in self.startup.metrics().items() if k != "timing_s/startup/total"}
        if self.first_step_at is not None:  # an RL run's first step began
            perf["timing_s/startup/total"] = self.first_step_at
        perf.update(memory)
        (run_dir / "perf.json").write_text(json.dumps(perf, indent=1) + "\n")

    # ----------------------------------------------------------------------------- RL
    def _rl(self, trainer, run_log, stop, resume_dir: Path | None, state: dict | None, pipeline) -> int:
        from megatron_agent.train.checkpointer import SaveError, Saver
        from megatron_agent.train.rl_loop import rl_step
        from megatron_agent.train.run_state import rollout_seed

        cfg, total = self.cfg, self.cfg.trainer.total_steps
        saver, validator = Saver(cfg, trainer, run_log, pipeline), Validator(cfg, trainer)
        if state is not None:
            done = self._resume(trainer, run_log, saver, resume_dir, state)
        else:
            done = self._fresh_start(trainer, run_log, saver, validator)
        for step in range(done + 1, total + 1):
            if stop.requested:
                break
            if pipeline is None:  # an async run reseeds the engines per admitted batch
                trainer.reseed_engines(rollout_seed(cfg.rollout.seed, step), step)
            metrics = rl_step(trainer, step, pipeline)
            if validator.due(step):
                metrics.update(validator())
            metrics["checkpoint/save_errors"] = float(saver.num_errors)
            metrics.update(self.memory.metrics())  # perf/peak_*: the process tree's peak so far
            run_log.log(step, metrics)
            done = step
            if saver.due(step) and not stop.requested:
                saver.save(done)
        final = saver.save(done)
        if final is None:
            raise SaveError(f"the final checkpoint (step {done}) could not be saved; see the warning above")
        if stop.requested:
            print(
                f"stopped by {stop.name} after step {done}; checkpoint: {final}; resume with trainer.resume=auto"
            )
            return 0
        print(f"checkpoint: {final}\nmetrics: {run_log.metrics_path}\nplot: {run_log.plot_path}")
        return 0

    def _fresh_start(self, trainer, run_log, saver, validator) -> int:
        """SFT warm start when configured, the first sync, validation before the first step."""
        from megatron_agent.train.sft_run import run_sft

        if self._sft_runs():
            with self.startup.phase("sft"):
                ckpt = run_sft(trainer, run_log, trainer.run_dir / "sft" / "checkpoint")
                logger.info("SFT checkpoint: %s", ckpt)
                trainer.restart_from(str(ckpt))
            saver.ref_from = str(ckpt)
        with self.startup.phase("first_sync"):
            trainer.make_update(self.plan.total_optimizer_steps)
            first = trainer.sync()
        with self.startup.phase("validation"):
            validation = validator() if validator.due(0) else {}
        skipped = {"data/skipped_rows": float(trainer.num_skipped_rows)}
        run_log.log(0, {**first, **validation, **skipped, **self._started(), **self.memory.metrics()})
        return 0

    def _resume(self, trainer, run_log, saver, resume_dir: Path, state: dict) -> int:
        """Restore the workers and the driver from `resume_dir`; returns the step it holds."""
        from megatron_agent.train.run_state import restore_driver_state

        resume_start = time.perf_counter()
        saver.ref_from = state.get("ref_from", "")
        if saver.ref_from:  # the reference is the SFT result: load it before the actor's state
            trainer.restart_from(saver.ref_from)
        trainer.make_update(self.plan.total_optimizer_steps)
        trainer.load_state(str(resume_dir))
        done = restore_driver_state(trainer, run_log, state)
        saver.last_saved = done
        saver.num_errors = int(state["history"][-1].get("checkpoint/save_errors", 0))
        # As if the actor updates of steps 1..done had synced (the sync labels it); a gae run's
        # first `trainer.critic_warmup` steps did not update the actor.
        warmup = min(done, self.cfg.trainer.critic_warmup) if self.plan.uses_critic else 0
        trainer.actor_version = done - warmup + 1
        trainer.sync()
        self.startup.add("resume", time.perf_counter() - resume_start)
        self._started()
        print(f"resumed from {resume_dir} (step {done}); continuing at step {done + 1}")
        return done


def async_pipeline(trainer, state: dict | None):
    """The admitted-rollout pipeline of an async run (None in sync mode), restored from a
    checkpoint's driver `state` when resuming. A checkpoint holding admitted batches resumes
    only in async mode with a bound at least as large as theirs (ConfigError otherwise)."""
    saved = (state or {}).get("async")
    plan = trainer.plan
    if plan.mode != "async":
        if saved and saved["batches"]:
            raise ConfigError(
                f"the checkpoint holds {len(saved['batches'])} generated, untrained batches of an async run: "
                "resume it with trainer.mode=async (or start a new run folder)"
            )
        return None
    from megatron_agent.train.async_rollouts import RolloutPipeline

    pipeline = RolloutPipeline(trainer, plan.max_staleness)
    if saved:
        if saved["max_staleness"] > plan.max_staleness and saved["batches"]:
            raise ConfigError(
                f"the checkpoint's batches were admitted under async.max_staleness={saved['max_staleness']}: "
                f"resuming with {plan.max_staleness} would train tokens older than the bound; "
                f"resume with async.max_staleness>={saved['max_staleness']}"
            )
        pipeline.load_state_dict(saved)
    return pipeline


def check_inputs_up_front(cfg: Config, *, sft: bool) -> None:
    """Check in the driver what the workers would read first: the `trainer.init_from` and
    `critic.init_from` checkpoints (every file against its manifest; the workers then check sizes only), when SFT runs the rows
    of `sft.data_path`, and on a local cluster the python tool's sandbox (it fails closed) and its
    worst case against this machine's memory. Raises an `InputError` naming the file (and row)
    or the key."""
    from megatron_agent.checkpoint.manifest import verify_manifest
    from megatron_agent.data.sft import load_sft_rows
    from megatron_agent.errors import InputError

    if "python" in cfg.tools.enabled and not cfg.ray.address:
        from megatron_agent.rollout.factory import build_toolset

        build_toolset(cfg, ["python"])  # what each engine builds (SandboxUnavailable, InputError)

    if cfg.trainer.init_from:
        verify_manifest(cfg.trainer.init_from)
    if cfg.critic.init_from:
        verify_manifest(cfg.critic.init_from)
    if sft and cfg.sft.data_path:
        rows, num_skipped = load_sft_rows(cfg.sft.data_path)
        if not rows:
            raise InputError(
                f"sft.data_path={cfg.sft.data_path!r} has no usable rows ({num_skipped} skipped, each "
                'named above): rows are {"messages": [...], "tools": [...]}'
            )


def _versions_ok() -> bool:
    from megatron_agent.platform.versions import check_versions

    problems = check_versions()
    for problem in problems:
        logger.warning("%s", problem)
    if any(p.startswith("error:") for p in problems):
        print("error: the installed versions cannot work together (see above)", file=sys.stderr)
        return False
    return True


def _error(exc: BaseException, status: int) -> int:
    from megatron_agent.errors import report

    return report(exc, status)
