"""Checkpoints: Megatron dist_checkpointing save/load (atomic, checksummed) and HF conversion.

`load_checkpoint`, `save_checkpoint` and `verify_checkpoint` (`model_io`, which imports torch and
megatron-core) are imported on first use: the driver reads manifests and layouts before Ray starts,
without torch.
"""

from megatron_agent.checkpoint.layout import read_meta
from megatron_agent.checkpoint.manifest import CheckpointIntegrityError, verify_manifest, write_manifest

_MODEL_IO = ("load_checkpoint", "save_checkpoint", "verify_checkpoint")

__all__ = ["CheckpointIntegrityError", *_MODEL_IO, "read_meta", "verify_manifest", "write_manifest"]


def __getattr__(name: str):
    if name in _MODEL_IO:
        from megatron_agent.checkpoint import model_io

        return getattr(model_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
