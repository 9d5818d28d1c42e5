"""A torch_dist save in which every tensor is produced only when the writer reaches it.

`dist_checkpointing.save` with Megatron's own strategy resolves every tensor of the state dict
before writing, so the whole model must sit in memory. For conversion we hand Megatron a
sharded state dict of meta-device tensors (from `meta_model.build_meta_chunks`, so keys,
shapes and sharding are Megatron's own) and write it with PyTorch DCP's file writer, one file
per tensor and a planner whose `resolve_data` asks a producer for the real values of the
parameter a meta tensor belongs to. Peak memory is then about one parameter (plus its HF
sources), whatever the model size. The files are an ordinary torch_dist checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

# producer(storage_id) -> the real, contiguous tensor (same shape) of the meta parameter with that storage
Producer = Callable[[int], torch.Tensor]


def storage_id(tensor: torch.Tensor) -> int:
    """An identity shared by a tensor and all its views (also for meta tensors)."""
    return tensor.untyped_storage()._cdata


def _strategy_class():
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazyPlanner(MCoreSavePlanner):
        """Resolves each tensor write item from the producer instead of the (meta) state dict."""

        def __init__(self, producer: Producer, **kwargs):
            super().__init__(**kwargs)
            self._producer = producer
            self._cached: tuple[int, torch.Tensor] | None = None

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            meta = self.lookup_object(write_item.index)
            sid = storage_id(meta)
            if self._cached is None or self._cached[0] != sid:
                self._cached = None  # free the previous parameter before producing the next
                self._cached = (sid, self._producer(sid))
            real = self._cached[1]
            if (
                not real.is_contiguous()
                or real.numel() * real.element_size() != meta.untyped_storage().nbytes()
            ):
                raise AssertionError(f"producer gave {tuple(real.shape)} for {write_item.index.fqn}")
            # as_strided offsets are absolute in the storage: add the real tensor's own offset.
            offset = real.storage_offset() + meta.storage_offset()
            return real.as_strided(meta.size(), meta.stride(), offset).contiguous()

    class LazyTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """torch_dist save strategy for meta-tensor state dicts whose values come from a producer."""

        def __init__(self, producer: Producer, hasher=None):
            super().__init__("torch_dist", 1)
            self._producer = producer
            self._hasher = hasher

        def save(self, sharded_state_dict, checkpoint_dir: Path):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter

            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            # One file per tensor: the writer keeps every tensor of a file alive until the file
            # is closed, so one file per rank would hold the whole shard in memory. No fsync per
            # file: the manifest pass (`manifest.write_manifest`) syncs every file it hashes.
            writer = FileSystemWriter(
                str(checkpoint_dir), single_file_per_rank=False, thread_count=1, sync_files=False
            )
            if self._hasher is not None:
                writer.fs = _HashingFileSystem(self._hasher)
            planner = LazyPlanner(
                self._producer,
                dedup_replicated_tensors=False,
                flatten_state_dict=False,
                flatten_sharded_tensors=False,
            )
            dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)

    class _HashingFileSystem(FileSystem):
        """DCP's local file system, handing every closed tensor file to a `BackgroundHasher`."""

        def __init__(self, hasher):
            super().__init__()
            self._hasher = hasher

        @contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                yield stream
            # Tensor files are final when closed (the metadata file is written under a temporary
            # name and renamed, so it is left to the manifest pass).
            if "w" in mode and str(path).endswith(".distcp"):
                self._hasher.submit(path)

    return LazyTorchDistSaveStrategy


def lazy_save(sharded_state_dict: dict, checkpoint_dir: str | Path, producer: Producer, hasher=None) -> None:
    """`dist_checkpointing.save` of a meta-tensor sharded state dict, values from `producer`.

    Collective over the default process group; `checkpoint_dir` must exist. With a
    `manifest.BackgroundHasher`, each tensor file is hashed and synced while the next is written.
    """
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(
        sharded_state_dict, str(checkpoint_dir), sharded_strategy=_strategy_class()(producer, hasher)
    )
