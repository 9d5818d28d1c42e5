"""`python -m megatron_agent train --config FILE key=value ...`: RL training of a tool-calling agent.

Starts (or joins, `ray.address`) a Ray cluster, the Megatron world (actor + reference) and the
rollout engines; runs SFT first when `sft.steps > 0` and no `trainer.init_from` is given; syncs
the actor's weights into the engines; validates; then runs `trainer.total_steps` RL steps
(`train/rl_loop.py`), validating every `trainer.test_freq` steps and after the last one.
"""

from __future__ import annotations

import argparse
import logging
import sys


def parse_args(prog: str, argv: list[str], doc: str) -> argparse.Namespace:
    """--config FILE plus key=value overrides."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=5")
    return parser.parse_args(argv)


def load(prog: str, argv: list[str], doc: str):
    """(config, None) or (None, exit status) after printing the error."""
    from megatron_agent.config import ConfigError, load_config

    args = parse_args(prog, argv, doc)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("ray", "vllm", "transformers", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return load_config(args.config, args.overrides), None
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None, 2


def make_trainer(cfg):
    """(Trainer, None), or (None, 2) after printing a config or data error."""
    from megatron_agent.config import ConfigError
    from megatron_agent.train.trainer import Trainer

    try:
        return Trainer(cfg), None
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None, 2


def main(argv: list[str]) -> int:
    """Run the train command; returns the exit status."""
    cfg, status = load("python -m megatron_agent train", argv, __doc__)
    if cfg is None:
        return status
    if cfg.checkpoint.on_save_error not in SAVE_ERROR_MODES:
        print(
            f"error: checkpoint.on_save_error={cfg.checkpoint.on_save_error!r}: choose stop or continue",
            file=sys.stderr,
        )
        return 2
    trainer, status = make_trainer(cfg)
    if trainer is None:
        return status
    from megatron_agent.train.run_state import find_resume, resolve_ref_from
    from megatron_agent.train.signals import StopRequest

    try:
        resume_dir, state = find_resume(cfg)
        if state is not None and state.get("ref_from"):  # stored relative to the run folder
            state["ref_from"] = str(resolve_ref_from(state["ref_from"], trainer.run_dir, resume_dir))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t = cfg.trainer
    if state is not None and state["step"] >= t.total_steps:
        print(
            f"the run is already finished: {resume_dir} is at step {state['step']} of "
            f"trainer.total_steps={t.total_steps}; nothing to do (raise trainer.total_steps to go on)"
        )
        return 0
    with StopRequest() as stop:
        return run(cfg, trainer, resume_dir, state, stop)


def run(cfg, trainer, resume_dir, state, stop) -> int:
    """Start the workers, restore or warm-start, and run the RL steps; returns the exit status."""
    from megatron_agent.config import config_to_dict
    from megatron_agent.platform.versions import check_versions
    from megatron_agent.train.actor_update import num_mini_batches
    from megatron_agent.train.cluster import WorkerError, start_ray, stop_ray
    from megatron_agent.train.rl_loop import rl_step, validate
    from megatron_agent.train.run_log import RunLogger
    from megatron_agent.train.run_state import restore_driver_state, rollout_seed
    from megatron_agent.train.sft_run import run_sft

    log = logging.getLogger("megatron_agent.train")
    problems = check_versions()
    for problem in problems:
        log.warning("%s", problem)
    if any(p.startswith("error:") for p in problems):
        print("error: the installed versions cannot work together (see above)", file=sys.stderr)
        return 2
    run_log = RunLogger(trainer.run_dir, cfg.logging, config_dict=config_to_dict(cfg))
    t = cfg.trainer
    saver = Saver(cfg, trainer, run_log)
    started_ray = False
    try:
        # ray.init installs Ray's own SIGTERM handler (a crash report): start Ray first, then ours.
        started_ray = start_ray(cfg.ray.address, cfg.ray.num_cpus)
        stop.install()
        trainer.start()
        num_mini = num_mini_batches(cfg)
        if state is not None:
            saver.ref_from = state.get("ref_from", "")  # resolved by main()
            if saver.ref_from:  # the reference is the SFT result: load it before the actor's state
                trainer.actors.call("restart_from", saver.ref_from)
                trainer.actors.call("connect_engines", trainer.engines.workers)
            trainer.make_update(t.total_steps * cfg.actor.ppo_epochs * num_mini)
            trainer.actors.call("load_state", str(resume_dir))
            done = restore_driver_state(trainer, run_log, state)
            saver.last_saved = done
            saver.num_errors = int(state["history"][-1].get("checkpoint/save_errors", 0))
            trainer.engines.call("set_weight_version", done)  # as if steps 1..done had synced
            trainer.sync()
            print(f"resumed from {resume_dir} (step {done}); continuing at step {done + 1}")
        else:
            if cfg.sft.steps > 0 and not t.init_from:
                ckpt = run_sft(trainer, run_log, trainer.run_dir / "sft" / "checkpoint")
                log.info("SFT checkpoint: %s", ckpt)
                trainer.actors.call("restart_from", str(ckpt))
                trainer.actors.call("connect_engines", trainer.engines.workers)
                saver.ref_from = str(ckpt)
            trainer.make_update(t.total_steps * cfg.actor.ppo_epochs * num_mini)
            first = trainer.sync()
            skipped = {"data/skipped_rows": float(trainer.num_skipped_rows)}
            run_log.log(0, {**first, **validate(trainer), **skipped})
            done = 0
        for step in range(done + 1, t.total_steps + 1):
            if stop.requested:
                break
            trainer.reseed_engines(rollout_seed(cfg.rollout.seed, step), step)
            metrics = rl_step(trainer, step)
            if step == t.total_steps or (t.test_freq and step % t.test_freq == 0):
                metrics.update(validate(trainer))
            metrics["checkpoint/save_errors"] = float(saver.num_errors)
            run_log.log(step, metrics)
            done = step
            if cfg.checkpoint.save_freq and step % cfg.checkpoint.save_freq == 0 and not stop.requested:
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
    except (WorkerError, SaveError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        run_log.close()
        trainer.close()
        if started_ray:
            stop_ray()


SAVE_ERROR_MODES = ("stop", "continue")


class SaveError(RuntimeError):
    """A checkpoint could not be written (checkpoint.on_save_error=stop, or the final save)."""


class Saver:
    """Whole-run checkpoints of the driver's run: save at a step, then rotate (checkpoint.keep_last).

    A failed save (a full disk, a quota, an I/O error on any rank) leaves no trace: its staging
    folder is removed, the previous checkpoints are untouched, and every rank is checked to have
    come back. Then `checkpoint.on_save_error=stop` raises `SaveError` naming the path and the
    newest complete checkpoint; `continue` warns, counts it (`checkpoint/save_errors`) and
    returns None.
    """

    def __init__(self, cfg, trainer, run_log):
        self.cfg, self.trainer, self.run_log = cfg, trainer, run_log
        self.ref_from = ""
        self.last_saved: int | None = None
        self.num_errors = 0

    def save(self, step: int):
        """Save the state after `step` (once per step), rotate, and return the folder (None: failed)."""
        import time

        from megatron_agent.train.cluster import WorkerError
        from megatron_agent.train.run_state import checkpoint_root, driver_state, rotate, step_dir

        root = checkpoint_root(self.cfg)
        path = step_dir(root, step)
        if self.last_saved == step and path.is_dir():
            return path
        start = time.perf_counter()
        state = driver_state(self.trainer, self.run_log, step, self.ref_from)
        try:
            self.trainer.actors.call("save_state", str(path), self.trainer.model_path, state)
        except WorkerError as exc:
            return self._failed(step, path, exc)
        rotate(root, self.cfg.checkpoint.keep_last)
        self.last_saved = step
        logging.getLogger("megatron_agent.train").info(
            "checkpoint %s saved in %.1f s", path, time.perf_counter() - start
        )
        return path

    def _failed(self, step: int, path, exc: Exception) -> None:
        from megatron_agent.train.run_state import discard_staging, newest_complete, space_note

        # Every rank must be back (a rank stuck in a collective or dead: WorkerError naming it);
        # Megatron raises the cause on its coordinator rank only: collect every rank's reason.
        reasons = [r for r in self.trainer.actors.call("last_save_error", timeout_s=120) if r]
        discard_staging(path)
        self.num_errors += 1
        previous = newest_complete(path.parent)
        keep = (
            f"the newest complete checkpoint is {previous}"
            if previous
            else "no complete checkpoint exists yet"
        )
        detail = "\n".join(reasons) or str(exc)
        message = (
            f"saving the checkpoint of step {step} to {path} failed ({keep}; {space_note(path.parent, previous)}):"
            f"\n{detail}"
        )
        if self.cfg.checkpoint.on_save_error == "stop":
            raise SaveError(
                f"{message}\nfree space under {path.parent} (or set checkpoint.save_dir), then rerun with "
                "trainer.resume=auto; checkpoint.on_save_error=continue keeps training instead"
            )
        logging.getLogger("megatron_agent.train").warning(
            "%s\ncheckpoint.on_save_error=continue: training goes on (%d failed saves so far)",
            message,
            self.num_errors,
        )
        return None
