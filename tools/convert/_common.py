"""Small helpers shared by the conversion command lines."""

from __future__ import annotations

import logging
import os
import resource
import shlex
import sys
import warnings


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
