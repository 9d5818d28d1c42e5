"""Small helpers shared by the conversion command lines, and their input checks.

Each converter checks every input (flags, folders, the checkpoint's manifest, the layout against
the model and the processes) in its main process before torch.distributed starts; a mistake is
an `InputError`, which `megatron_agent.errors.run_command` reports as one `error:` line with exit
status 2.
"""

from __future__ import annotations

import logging
import os
import resource
import shlex
import sys
import warnings
from pathlib import Path

from megatron_agent.errors import InputError, check_positive, check_world_size
from megatron_agent.models.hf_config import check_parallel_fit


def quiet() -> None:
    """Silence the library warnings and progress bars that bury the tool's own output."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)


def report_peak() -> str:
    """This process's peak resident memory, as text."""
    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"


def check_layout(tool: str, tp: int, pp: int, vpp: int = 1, *, keep: bool, arch=None) -> tuple[int, int, int]:
    """The (tp, pp, vpp) to run with, given torchrun's WORLD_SIZE (1 without torchrun).

    Each size must be >= 1 and, given the model's `arch`, split it (tp divides its attention and
    key/value heads, pp * vpp its layers). A world size that tp*pp does not divide is a usage
    error that says how to launch the tool; except, with `keep=False` (the layout only splits the
    work, as in hf_to_megatron.py), a single process runs at tp=pp=vpp=1 and says so. Every
    refusal is an `InputError` (exit status 2).
    """
    check_positive({"--tp": tp, "--pp": pp, "--vpp": vpp})
    if vpp > 1 and pp == 1:
        raise InputError(f"--vpp {vpp} needs --pp > 1 (virtual stages split each pipeline stage)")
    if arch is not None:
        check_parallel_fit(arch, tp, pp, vpp)
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
    check_world_size(flags, model_parallel, again)
    return tp, pp, vpp


def check_out(path: str, overwrite: bool) -> None:
    """Refuse an existing output folder without --overwrite, before any work starts."""
    if Path(path).exists() and not overwrite:
        raise InputError(f"--out {path} exists: pass --overwrite to replace it, or choose another folder")


def check_checkpoint(path: str | Path, *, hashes: bool, flag: str = "--ckpt") -> dict:
    """Verify a checkpoint folder's manifest (every file's size, and its sha256 when `hashes`)
    and read its meta.json; returns the meta. Raises `InputError` naming the folder or the file."""
    from megatron_agent.checkpoint.layout import META, read_meta
    from megatron_agent.checkpoint.manifest import CheckpointIntegrityError, verify_manifest

    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"{flag} {path}: no such folder: give a checkpoint folder (model/, hf/, meta.json)")
    if not (folder / META).is_file():
        raise InputError(
            f"{flag} {path}: no {META} in this folder: not a megatron-agent checkpoint "
            "(convert an HF model with tools/convert/hf_to_megatron.py, or give a `train`/`sft` checkpoint)"
        )
    try:
        verify_manifest(folder, hashes=hashes)
    except CheckpointIntegrityError as exc:
        raise CheckpointIntegrityError(f"{flag} {path}: {exc}") from None
    try:
        return read_meta(folder)
    except (OSError, ValueError) as exc:
        raise InputError(f"{flag} {path}: {exc}") from None


def resolve_checkpoint(path: str, *, hashes: bool) -> tuple[Path, bool]:
    """The checkpoint folder that `path` names, checked against its manifest before any work.

    `path` is a checkpoint folder (meta.json: converted, or a training `step_N`), which is
    verified (every file's size and, with `hashes`, sha256: an altered file is an `InputError`
    naming it); or a run folder (`trainer.run_dir`: its `checkpoints/`), or a folder of `step_N`
    checkpoints (`checkpoint.save_dir`); for the last two, the newest complete checkpoint is
    taken and each refused one is named on stderr with the reason. No complete checkpoint: an
    `InputError` saying what was looked at. Returns (folder, whether its sha256 were verified).
    """
    from megatron_agent.checkpoint.layout import META
    from megatron_agent.checkpoint.manifest import CheckpointIntegrityError, verify_manifest
    from megatron_agent.train.run_state import list_checkpoints

    folder = Path(path)
    if (folder / META).is_file():
        check_checkpoint(folder, hashes=hashes)
        return folder, hashes
    if not folder.is_dir():
        raise InputError(
            f"--ckpt {path}: no such folder: give a checkpoint folder, a run folder (trainer.run_dir) "
            "or a folder of step_N checkpoints"
        )
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
    raise InputError(
        f"--ckpt {path}: not a checkpoint folder (no {META}) and {root} holds {looked}; give a "
        "checkpoint folder, a run folder (trainer.run_dir) or a folder of step_N checkpoints"
    )
