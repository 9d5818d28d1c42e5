"""Megatron model-parallel state: initialise and tear down TP x PP (x VPP) groups."""

from __future__ import annotations

import torch.distributed as dist

from megatron_agent.platform.hidden_imports import hidden_imports

MEGATRON_UNUSED_IMPORTS = ("wandb", "tensorboard")
"""Hidden while megatron-core first imports (`platform/hidden_imports.py`): its timers import wandb
and TensorBoard for writers this project never gives them (the driver logs the run). 23 MB and
0.4-0.5 s of every rank's start."""


def init_model_parallel(tp: int = 1, pp: int = 1, vpp: int = 1, seed: int = 42) -> None:
    """Create Megatron's TP/PP/DP groups over the default process group and seed the TP RNG."""
    with hidden_imports(MEGATRON_UNUSED_IMPORTS):
        from megatron.core import parallel_state as ps

    from megatron_agent.platform.setup import init_distributed, seed_everything

    init_distributed()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp={tp * pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    seed_everything(seed)


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups (the default process group stays)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
