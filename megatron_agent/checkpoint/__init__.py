"""Checkpoints: Megatron dist_checkpointing save/load (atomic, checksummed) and HF conversion."""

from megatron_agent.checkpoint.layout import read_meta
from megatron_agent.checkpoint.manifest import CheckpointIntegrityError, verify_manifest, write_manifest
from megatron_agent.checkpoint.model_io import load_checkpoint, save_checkpoint, verify_checkpoint

__all__ = [
    "CheckpointIntegrityError",
    "load_checkpoint",
    "read_meta",
    "save_checkpoint",
    "verify_checkpoint",
    "verify_manifest",
    "write_manifest",
]
