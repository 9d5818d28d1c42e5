"""Choose the device and process-group backend, start torch.distributed, seed every RNG."""

from __future__ import annotations

import atexit
import os
import random
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


def has_cuda() -> bool:
    """True where a CUDA GPU is usable."""
    return torch.cuda.is_available()


def backend_name() -> str:
    """The torch.distributed backend for this machine: nccl with CUDA, gloo otherwise."""
    return "nccl" if has_cuda() else "gloo"


def device() -> torch.device:
    """The compute device of this rank (its local GPU, or the CPU)."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int]:
    """Start the default process group from torchrun's environment (or as a single rank).

    On CPU the megatron-core CUDA redirection is enabled first. Returns (rank, world_size).
    """
    quiet_megatron()
    if not has_cuda():
        from megatron_agent.platform import cuda_on_cpu

        cuda_on_cpu.enable()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if has_cuda():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend_name(), timeout=timedelta(minutes=timeout_minutes))
    if dist.get_backend() == "gloo":
        atexit.register(destroy_gloo_groups_at_exit)
    return dist.get_rank(), dist.get_world_size()


def destroy_gloo_groups_at_exit() -> None:
    """Destroy this process's gloo groups while Python is still whole (registered at exit by
    `init_distributed`).

    A gloo collective's worker thread drops its last reference to the collective's tensors after
    the caller has been told it finished. When that happens while the interpreter finalizes (a
    script that ends right after an all-reduce or a barrier), the thread cannot take the GIL to
    release them, is made to exit inside a destructor, and the process aborts with "terminate
    called without an active exception" (exit status -6: 2 of 30 runs of a probe here). Destroying
    the groups first joins those threads. Commands that leave through `exit_process` never
    finalize; this is for every other way out (test workers, probes, users' scripts)."""
    if not dist.is_initialized():
        return
    if "megatron.core.parallel_state" in sys.modules:  # not imported only to find nothing there
        from megatron_agent.platform.parallel import destroy_model_parallel

        destroy_model_parallel()
    dist.destroy_process_group()


def quiet_megatron() -> None:
    """Silence megatron-core's import-time warnings (Apex/TE fallbacks, deprecations)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*(Apex|apex|Transformer Engine|TE).*")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch and (when model parallel is initialised) Megatron's TP RNG."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
