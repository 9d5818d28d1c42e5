"""Run state of one Megatron rank: the actor's optimizer (dist checkpoint), the update's counters
and schedule, and the RNG states. Used by `MegatronWorker.save_state` / `load_state`.

The optimizer is saved with Megatron's sharded state dict in the fully reshardable format, so it
loads at another TP x PP (x DP) layout like the weights do.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

from megatron_agent.checkpoint.model_io import keep_write_results_in_process, model_sharded_state_dict

logger = logging.getLogger("megatron_agent.train")

OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def save_optimizer(model, folder: Path) -> None:
    """Collective: the optimizer state of `model` (a trainable `MegatronModel`) into `folder`."""
    from megatron.core import dist_checkpointing

    keep_write_results_in_process()
    sharded = model.optimizer.sharded_state_dict(
        model_sharded_state_dict(model.chunks), is_loading=False, metadata=OPTIM_METADATA
    )
    dist_checkpointing.save(sharded, str(folder))


def load_optimizer(model, folder: Path) -> None:
    """Collective: load an optimizer state written by `save_optimizer` (any saved layout)."""
    from megatron.core import dist_checkpointing

    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} not found: the checkpoint has no optimizer state to resume from")
    sharded = model.optimizer.sharded_state_dict(
        model_sharded_state_dict(model.chunks), is_loading=True, metadata=OPTIM_METADATA
    )
    model.optimizer.load_state_dict(dist_checkpointing.load(sharded, str(folder)))


def trainer_state(update) -> dict:
    """The PPO update's LR scheduler, optimizer-step counter and guard counters."""
    return {
        "scheduler": update.scheduler.state_dict(),
        "optimizer_steps": update.optimizer_steps,
        "guard": update.guard.state_dict(),
    }


def load_trainer_state(update, state: dict) -> None:
    """Restore `trainer_state` into a freshly made update."""
    update.scheduler.load_state_dict(state["scheduler"])
    update.optimizer_steps = int(state["optimizer_steps"])
    update.guard.load_state_dict(state["guard"])


def rng_state() -> dict:
    """This process's python, numpy and torch RNG states (and Megatron's TP RNG tracker's)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["tracker"] = get_cuda_rng_tracker().get_states()
    except Exception as exc:  # noqa: BLE001 - the tracker is optional state (no dropout on CPU)
        logger.debug("TP RNG tracker state not saved: %s", exc)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(path: Path, *, seed: int) -> None:
    """Restore `rng_state()` from `path`; without that file, seed every RNG with `seed` and say so."""
    if not path.is_file():
        logger.warning(
            "%s not found (the layout has more ranks than the saved one): seeding with %d", path, seed
        )
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        return
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        try:
            get_cuda_rng_tracker().set_states(state["tracker"])
        except Exception as exc:  # noqa: BLE001 - a tracker of another layout has other names
            logger.warning("TP RNG tracker state not restored: %s", exc)


def save_error_message(exc: BaseException, ckpt_dir: str | Path, rank: int) -> str:
    """What went wrong while writing `ckpt_dir` on `rank`, with the errors found underneath.

    Megatron's distributed save turns a failed write into a `CheckpointException` whose text names
    no cause (and on ranks other than the coordinator holds none): the causes are looked for in
    its `failures` (exceptions gathered from the ranks, their chains lost on the way) and in the
    `__cause__` / `__context__` chain. A full file system (ENOSPC, EDQUOT) is said so, with the
    space left there.
    """
    import errno
    import shutil

    found: list[BaseException] = []
    seen: set[int] = set()

    def walk(e) -> None:
        if e is None or id(e) in seen:
            return
        seen.add(id(e))
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # torch.distributed.checkpoint.CheckpointException
            for failure in failures.values():
                walk(failure[0] if isinstance(failure, tuple) else failure)
        else:
            found.append(e)
        walk(e.__cause__)
        walk(e.__context__)

    walk(exc)
    found.sort(key=lambda e: not isinstance(e, OSError))  # OS errors first: they say what happened
    causes = list(dict.fromkeys(f"{type(e).__name__}: {e}" for e in found)) or [
        f"{type(exc).__name__}: {exc}"
    ]
    message = f"writing the checkpoint {ckpt_dir} failed on rank {rank}: {'; '.join(causes[:3])}"
    full = any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for e in found)
    if full or any(text in c for c in causes for text in ("No space left on device", "Disk quota exceeded")):
        parent = Path(ckpt_dir).parent
        message += f" (the file system of {parent} is full or over quota"
        try:
            usage = shutil.disk_usage(parent)
            message += f": {usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB now"
        except OSError:
            pass
        message += ")"
    return message
