"""Small helpers shared by the conversion command lines."""

from __future__ import annotations

import logging
import os
import resource
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
