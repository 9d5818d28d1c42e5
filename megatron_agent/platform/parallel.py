"""Megatron model-parallel state: initialise and tear down TP x PP (x VPP) groups."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_agent.platform.deferred_compile import deferred_torch_compile
from megatron_agent.platform.hidden_imports import hidden_imports

MEGATRON_UNUSED_IMPORTS = ("wandb", "tensorboard")
"""Hidden while megatron-core first imports (`platform/hidden_imports.py`): its timers import wandb
and TensorBoard for writers this project never gives them (the driver logs the run). 23 MB and
0.4-0.5 s of every rank's start."""


def import_megatron_core() -> None:
    """Import megatron-core for a rank: without `MEGATRON_UNUSED_IMPORTS`, and on CPU with its
    import-time `torch.compile` calls deferred to their first call (`platform/deferred_compile.py`:
    its fused kernels, which a CPU rank never calls). Nothing happens once it is imported."""
    with hidden_imports(MEGATRON_UNUSED_IMPORTS), deferred_torch_compile(not torch.cuda.is_available()):
        import megatron.core  # noqa: F401


def init_model_parallel(tp: int = 1, pp: int = 1, vpp: int = 1, seed: int = 42) -> None:
    """Create Megatron's TP/PP/DP groups over the default process group and seed the TP RNG."""
    import_megatron_core()
    from megatron.core import parallel_state as ps

    from megatron_agent.platform.setup import init_distributed, seed_everything

    init_distributed()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp={tp * pp}")
    destroy_model_parallel()  # a second layout in this process: the first one's groups go
    before = set(process_groups())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    _groups_made[:] = [group for group in process_groups() if group not in before]
    seed_everything(seed)


_groups_made: list = []
"""The process groups the current `init_model_parallel` created (its layout's TP, PP, DP, ... groups)."""


def process_groups() -> list:
    """Every process group torch holds in this process, the default one included (torch's
    registry; empty where this torch keeps it elsewhere)."""
    from torch.distributed import distributed_c10d

    return list(getattr(getattr(distributed_c10d, "_world", None), "pg_map", None) or ())


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups (the default process group stays).

    megatron-core only drops its references to the groups of a layout (it destroys the few it made
    with gloo explicitly); torch keeps every group alive until it is destroyed, and on CPU each
    gloo group keeps its threads. A process that builds many layouts (a test of every layout, a
    conversion tool) then slowed down with each one: tests/models/test_layouts.py's launch (4 ranks
    on 2 cores, 26 layouts) made 25.6 million context switches and took 187 s, 265 s of it system
    time; with the groups destroyed 0.5 million, 36 s and 13 s, with the same results bit for bit.
    So the gloo groups `init_model_parallel` made are destroyed here too (every rank calls this
    together). NCCL groups stay as megatron-core leaves them."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    made, _groups_made[:] = list(_groups_made), []
    alive = set(process_groups())
    for group in made:
        if group in alive and dist.get_backend(group) == "gloo":
            dist.destroy_process_group(group)
