"""Whole-run checkpoints of the driver: when to save (the cadence), saving, rotation, failures.

The `Saver` decides when it acts (`due(step)`: every `checkpoint.save_freq` steps; the run also
saves at its end), writes the state of every rank and of the driver (`MegatronWorker.save_state`,
`run_state.driver_state`), keeps `checkpoint.keep_last` complete checkpoints, and turns a failed
save into `SaveError` or a counted warning (`checkpoint.on_save_error`).
"""

from __future__ import annotations

import logging

from megatron_agent.errors import RunFailure


class SaveError(RunFailure):
    """A checkpoint could not be written (checkpoint.on_save_error=stop, or the final save)."""


class Saver:
    """Whole-run checkpoints of the driver's run: save at a step, then rotate (checkpoint.keep_last).

    A failed save (a full disk, a quota, an I/O error on any rank) leaves no trace: its staging
    folder is removed, the previous checkpoints are untouched, and every rank is checked to have
    come back. Then `checkpoint.on_save_error=stop` raises `SaveError` naming the path and the
    newest complete checkpoint; `continue` warns, counts it (`checkpoint/save_errors`) and
    returns None.
    """

    def __init__(self, cfg, trainer, run_log, pipeline=None):
        """`pipeline`: an async run's admitted rollouts (`RolloutPipeline`), saved with the
        driver's state; None in sync mode."""
        self.cfg, self.trainer, self.run_log, self.pipeline = cfg, trainer, run_log, pipeline
        self.ref_from = ""
        self.last_saved: int | None = None
        self.num_errors = 0

    def due(self, step: int) -> bool:
        """True when the cadence (`checkpoint.save_freq`) saves after `step`."""
        freq = self.cfg.checkpoint.save_freq
        return bool(freq) and step % freq == 0

    def save(self, step: int):
        """Save the state after `step` (once per step), rotate, and return the folder (None: failed)."""
        import time

        from megatron_agent.train.cluster import WorkerError
        from megatron_agent.train.run_state import driver_state, rotate, step_dir

        root = self.trainer.plan.checkpoint_root
        path = step_dir(root, step)
        if self.last_saved == step and path.is_dir():
            return path
        start = time.perf_counter()
        state = driver_state(self.trainer, self.run_log, step, self.ref_from)
        if self.pipeline is not None:
            state["async"] = self.pipeline.state_dict()  # waits for the admitted batches
        try:
            staged = self._stage_critic(path)
            self.trainer.actors.call("save_state", str(path), self.trainer.model_path, state, staged)
        except WorkerError as exc:
            return self._failed(step, path, exc)
        rotate(root, self.cfg.checkpoint.keep_last)
        self.last_saved = step
        logging.getLogger("megatron_agent.train").info(
            "checkpoint %s saved in %.1f s", path, time.perf_counter() - start
        )
        return path

    def _stage_critic(self, path) -> str:
        """A separate critic's folder of the checkpoint at `path`, written by its own ranks into
        a staging folder next to it (a failed save's cleanup removes it); '' when colocated."""
        if self.trainer.critics is None:
            return ""
        from megatron_agent.weights.folders import staging_dir

        return self.trainer.critics.call("save_critic", str(staging_dir(path)))[0]

    def _failed(self, step: int, path, exc: Exception) -> None:
        from megatron_agent.train.run_state import discard_staging, newest_complete, space_note

        # Every rank must be back (a rank stuck in a collective or dead: WorkerError naming it);
        # Megatron raises the cause on its coordinator rank only: collect every rank's reason.
        reasons = [
            r
            for group in self.trainer.megatron_groups()
            for r in group.call("last_save_error", timeout_s=120)
            if r
        ]
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
