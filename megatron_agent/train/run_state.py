"""Whole-run checkpoints, driver side: where they live, which one a run resumes from, what the
driver itself saves, and the keep-last rotation.

A run checkpoint is `<checkpoint.save_dir or run_dir/checkpoints>/step_NNNNNN/`, written by the
Megatron ranks (`MegatronWorker.save_state`) through `checkpoint.model_io.save_checkpoint`, so it
is published atomically (staging folder, checksummed manifest, rename) and loads at any layout:

```
step_NNNNNN/
  model/               actor weights (Megatron dist checkpoint)
  optim/               actor optimizer state (dist checkpoint, fully reshardable)
  trainer/worker.pt    LR scheduler, PPO optimizer-step counter, guard counters (rank 0)
  trainer/rng_rank*.pt python / numpy / torch RNG states of every Megatron rank
  trainer/driver.json  step, sampler position, metrics history, driver RNG, rollout seed base,
                       KL controller, the reference's checkpoint (relative to the run folder)
  hf/  meta.json  manifest.json
```
Paths inside the run folder are stored relative to it, so a run folder moved or copied elsewhere
resumes from its own files.
Dynamic sampling keeps no groups across steps (a step draws until its batch is full and drops
the rest), so there is no buffer to save.

A checkpoint once written is never lost to a later run: `find_resume` refuses (exit 2) when
step folders exist and none verifies, and `set_aside_before_writing` moves every folder that the
run would otherwise write over (newer than its resume point, or all of them on a fresh start,
and an earlier SFT checkpoint) into `previous-<time>/` or `damaged-<time>/` beside it. The
keep-last rotation removes only complete checkpoints, never a damaged one.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import time
from pathlib import Path

from megatron_agent.checkpoint.manifest import CheckpointIntegrityError, verify_manifest
from megatron_agent.config.plan import checkpoint_root
from megatron_agent.errors import InputError

logger = logging.getLogger("megatron_agent.train")

STATE_DIR = "trainer"
DRIVER_FILE = "driver.json"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


def step_dir(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint after `step`."""
    return Path(root) / f"step_{step:06d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_NNNNNN` folder under `root`, oldest first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def check_run_checkpoint(path: str | Path, *, hashes: bool = True) -> dict:
    """Verify a run checkpoint (every file against the manifest) and return its driver state.

    Raises `CheckpointIntegrityError` naming the bad file, or ValueError for a weights-only
    checkpoint (e.g. from `sft`), which cannot be resumed from.
    """
    path = Path(path)
    verify_manifest(path, hashes=hashes)
    driver = path / STATE_DIR / DRIVER_FILE
    if not driver.is_file():
        raise ValueError(
            f"{path} holds no trainer state ({driver} missing): it is a weights-only checkpoint; "
            "start from it with trainer.init_from instead of trainer.resume"
        )
    return json.loads(driver.read_text())


def find_resume(cfg) -> tuple[Path | None, dict | None]:
    """The checkpoint `trainer.resume` selects and its driver state, or (None, None).

    'never': none. 'auto': the newest checkpoint under `checkpoint_root(cfg)` that verifies (every
    file's sha256); a damaged one is refused with a warning naming the file, and the previous one
    is tried; step folders of which none verifies are an `InputError` naming each (a fresh start
    would write over them). A PATH must verify, else the error (naming the file) is raised.
    """
    mode = cfg.trainer.resume
    if mode == "never":
        return None, None
    if mode != "auto":
        path = Path(mode)
        if not path.is_dir():
            raise InputError(f"trainer.resume={mode!r}: no such checkpoint folder")
        return path, check_run_checkpoint(path)
    root, refused = checkpoint_root(cfg), []
    for _step, path in reversed(list_checkpoints(root)):
        try:
            return path, check_run_checkpoint(path)
        except (CheckpointIntegrityError, ValueError) as exc:
            logger.warning("refusing checkpoint %s: %s; trying the previous one", path, exc)
            refused.append(f"{path}: {exc}")
    if refused:
        raise InputError(
            f"trainer.resume=auto: none of the {len(refused)} checkpoint(s) under {root} verifies:\n  "
            + "\n  ".join(refused)
            + "\nThey are left as they are. Choose: trainer.resume=PATH (one of them, once repaired), or "
            f"trainer.resume=never (a fresh start; they are moved aside to {root}/damaged-<time>/, "
            "never written over)"
        )
    return None, None


def is_complete(path: str | Path) -> bool:
    """True when every file of the checkpoint `path` has the size its manifest records."""
    try:
        verify_manifest(path, hashes=False)
    except CheckpointIntegrityError:
        return False
    return True


def set_aside(path: Path, label: str) -> Path:
    """Move `path` into `<its folder>/<label>-<UTC time>/` (never over anything); returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = path.parent / f"{label}-{stamp}" / path.name
    suffix = 1
    while target.exists():
        target = path.parent / f"{label}-{stamp}.{suffix}" / path.name
        suffix += 1
    target.parent.mkdir(parents=True, exist_ok=True)
    path.rename(target)
    logger.warning("moved %s aside to %s (this run would have written over it)", path, target)
    return target


def set_aside_before_writing(cfg, resume_step: int | None, *, sft_runs: bool) -> list[Path]:
    """Move aside what the run would write over: the step folders newer than `resume_step` (all
    of them on a fresh start, `resume_step` None), as `damaged-*` when they failed verification
    (or miss a file or bytes) and `previous-*` otherwise, and on a fresh start that runs SFT an earlier `sft/checkpoint`. Returns the new paths."""
    moved = []
    # resume=auto took the newest checkpoint that verifies: every newer one failed its sha256
    failed_newer = resume_step is not None and cfg.trainer.resume == "auto"
    for step, path in list_checkpoints(checkpoint_root(cfg)):
        if resume_step is None or step > resume_step:
            damaged = failed_newer or not is_complete(path)
            moved.append(set_aside(path, "damaged" if damaged else "previous"))
    sft = Path(cfg.trainer.run_dir) / "sft" / "checkpoint"
    if resume_step is None and sft_runs and sft.exists():
        moved.append(set_aside(sft, "previous"))
    return moved


def rollout_seed(base: int, step: int) -> int:
    """The rollout engines' seed for `step` (engine i adds i): a resumed step samples as it would have."""
    return (base * 1_000_003 + step * 7919) % (2**31 - 1)


def driver_state(trainer, run_log, step: int, ref_from: str) -> dict:
    """What the driver saves: step, sampler position, metrics history, its RNG, the rollout seed
    and the KL controller.

    `ref_from`: the checkpoint the reference weights came from ('' for model.path or init_from);
    stored relative to the run folder when it lies inside it (`portable_path`).
    """
    from megatron_agent.train.run_log import to_json_value

    return {
        "step": step,
        "total_steps": trainer.cfg.trainer.total_steps,
        "sampler": trainer.sampler.state_dict(),
        "history": [{k: to_json_value(v) for k, v in row.items()} for row in run_log.history],
        "python_rng": _jsonable_rng(random.getstate()),
        "rollout_seed": trainer.cfg.rollout.seed,
        "ref_from": portable_path(ref_from, trainer.run_dir) if ref_from else "",
        "kl_ctrl": trainer.kl_ctrl.state_dict(),
    }


def portable_path(path: str | Path, run_dir: str | Path) -> str:
    """`path` relative to `run_dir` (posix) when it lies inside it, else absolute."""
    path, run_dir = Path(path).resolve(), Path(run_dir).resolve()
    return path.relative_to(run_dir).as_posix() if path.is_relative_to(run_dir) else str(path)


def resolve_ref_from(stored: str, run_dir: str | Path, resume_dir: str | Path) -> Path:
    """The folder a saved `ref_from` names, for a run resumed in `run_dir` from `resume_dir`.

    A relative path is looked up in `run_dir`, then in the run folder that holds `resume_dir`
    (`<run>/checkpoints/step_N`, for trainer.resume=PATH into another run folder). Missing
    everywhere: FileNotFoundError naming the places tried and the fix.
    """
    path = Path(stored)
    tried = [path] if path.is_absolute() else [Path(run_dir) / path, Path(resume_dir).parent.parent / path]
    for candidate in tried:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"the reference checkpoint of {resume_dir} ({stored!r}) is in none of: "
        f"{', '.join(str(p) for p in tried)}; copy the run folder whole (its sft/ folder included) "
        "or start a new run with trainer.resume=never"
    )


def restore_driver_state(trainer, run_log, state: dict) -> int:
    """Put the sampler, the metrics history, the driver RNG and the KL controller back; returns
    the saved step."""
    trainer.sampler.load_state_dict(state["sampler"])
    run_log.load_history(state["history"])
    if "kl_ctrl" in state:
        trainer.kl_ctrl.load_state_dict(state["kl_ctrl"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("rollout_seed", trainer.cfg.rollout.seed) != trainer.cfg.rollout.seed:
        logger.warning(
            "rollout.seed=%s differs from the checkpoint's %s: resumed rollouts sample differently",
            trainer.cfg.rollout.seed,
            state["rollout_seed"],
        )
    return int(state["step"])


def _jsonable_rng(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rotate(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (0: keep all); returns the deleted.

    Run right after a save is published. Complete means the manifest's files are all present at
    their recorded sizes; the newest complete one is never deleted, nor is a damaged folder (its
    intact files may be all a user can recover); leftover staging folders are removed.
    """
    root = Path(root)
    if keep_last <= 0:
        return []
    complete = [path for _, path in list_checkpoints(root) if is_complete(path)]
    if not complete:
        return []
    doomed = complete[:-keep_last] + [p for p in root.glob(".step_*.tmp-*") if p.is_dir()]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed old checkpoint %s (checkpoint.keep_last=%d)", path, keep_last)
    return doomed


def discard_staging(final: str | Path) -> list[Path]:
    """Remove the staging folders of a failed save of `final` (`.<name>.tmp-*`); returns them."""
    final = Path(final)
    removed = [p for p in final.parent.glob(f".{final.name}.tmp-*") if p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed the staging folder %s of a failed save", path)
    return removed


def newest_complete(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` whose files all match the manifest's sizes, or None."""
    return next((path for _, path in reversed(list_checkpoints(root)) if is_complete(path)), None)


def space_note(root: str | Path, previous: Path | None) -> str:
    """Free space under `root`, and whether it is less than `previous` (a checkpoint) takes: the
    likely cause of a failed save even where the writer's own error lost it (Megatron's does)."""
    try:
        usage = shutil.disk_usage(root)
    except OSError as exc:
        return f"the free space under {root} is unknown ({exc})"
    note = f"{root} has {usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
    if previous is not None:
        need = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file())
        if usage.free < need:
            note += f", less than the {need / 2**20:.1f} MiB the previous checkpoint takes: the disk is full"
    return note
