"""Small helpers shared by the conversion command lines."""

from __future__ import annotations

import logging
import os
import resource
import shlex
import sys
import warnings
from pathlib import Path


def quiet() -> None:
    """Silence the library warnings and progress bars that bury the tool's own output."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)


def report_peak() -> str:
    """This process's peak resident memory, as text."""
    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"


def check_layout(tool: str, tp: int, pp: int, vpp: int = 1, *, keep: bool) -> tuple[int, int, int]:
    """The (tp, pp, vpp) to run with, given torchrun's WORLD_SIZE (1 without torchrun).

    A world size that tp*pp does not divide is a usage error (exit status 2) that says how to
    launch the tool; except, with `keep=False` (the layout only splits the work, as in
    hf_to_megatron.py), a single process runs at tp=pp=vpp=1 and says so.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = tp * pp
    if world % model_parallel == 0:
        return tp, pp, vpp
    again = f"torchrun --nproc_per_node {model_parallel} tools/convert/{tool} {shlex.join(sys.argv[1:])}"
    flags = f"--tp {tp} --pp {pp}" + (f" --vpp {vpp}" if vpp > 1 else "")
    if world == 1 and not keep:
        print(
            f"note: {flags} only split the work over torchrun processes; the checkpoint is the same "
            f"and loads at any TP/PP layout. This is a single process (no torchrun), so it runs with "
            f"tp=1 pp=1. To split the work over {model_parallel} processes: {again}",
            file=sys.stderr,
        )
        return 1, 1, 1
    launched = "one process (no torchrun)" if world == 1 else f"{world} torchrun processes"
    print(
        f"error: {flags} need a multiple of tp*pp={model_parallel} processes, but this is {launched}. "
        f"Run: {again}",
        file=sys.stderr,
    )
    raise SystemExit(2)


def resolve_checkpoint(path: str, *, hashes: bool) -> tuple[Path, bool]:
    """The checkpoint folder that `path` names, and whether its checksums were verified here.

    `path` is a checkpoint folder (meta.json: converted, or a training `step_N`), a run folder
    (`trainer.run_dir`: its `checkpoints/`), or a folder of `step_N` checkpoints
    (`checkpoint.save_dir`); for the last two, the newest complete checkpoint is taken (every
    file against its manifest; `hashes=False`: sizes only) and each refused one is named on
    stderr with the reason. No complete checkpoint: a ValueError saying what was looked at.
    """
    from megatron_agent.checkpoint.layout import META
    from megatron_agent.checkpoint.manifest import CheckpointIntegrityError, verify_manifest
    from megatron_agent.train.run_state import list_checkpoints

    folder = Path(path)
    if (folder / META).is_file():
        return folder, False
    if not folder.is_dir():
        raise ValueError(f"--ckpt {path}: no such folder")
    root = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
    found = list_checkpoints(root)
    for _, candidate in reversed(found):
        try:
            verify_manifest(candidate, hashes=hashes)
        except CheckpointIntegrityError as exc:
            print(f"note: skipping {candidate}: {exc}", file=sys.stderr)
            continue
        print(f"exporting {candidate}, the newest complete checkpoint of {root}", file=sys.stderr)
        return candidate, hashes
    looked = f"{len(found)} step_N folder(s), none complete" if found else "no step_N folders"
    raise ValueError(
        f"--ckpt {path}: not a checkpoint folder (no {META}) and {root} holds {looked}; give a "
        "checkpoint folder, a run folder (trainer.run_dir) or a folder of step_N checkpoints"
    )
