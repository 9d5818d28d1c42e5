"""Streaming reads of HF safetensors checkpoints, one tensor at a time.

Follows `model.safetensors.index.json` when the checkpoint is sharded. Tensors are read through
safetensors' memory map, so only the tensor asked for is brought into memory; `get_slice` reads
part of one (a range of rows touches only those rows' pages of the file).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch

from megatron_agent.models.hf_config import INDEX_FILE, SINGLE_FILE


class HFCheckpointReader:
    """Random access to the tensors of an HF checkpoint folder by name. Use as a context manager."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._name_to_file = self._index()
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def _index(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map' mapping")
            for file in set(weight_map.values()):
                if not (self.path / file).is_file():
                    raise FileNotFoundError(f"{self.path / file} (listed in {INDEX_FILE}) is missing")
            return dict(weight_map)
        single = self.path / SINGLE_FILE
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                return {name: SINGLE_FILE for name in f.keys()}
        raise FileNotFoundError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._name_to_file)

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (raises KeyError naming it when absent)."""
        return self._handle(name).get_tensor(name)

    def get_slice(self, name: str):
        """safetensors' lazy slice of one tensor: `.get_shape()`, `[a:b]`, `[:, a:b]` read only that part."""
        return self._handle(name).get_slice(name)

    def _handle(self, name: str):
        if name not in self._name_to_file:
            raise KeyError(f"tensor {name!r} not found in {self.path}")
        file = self._name_to_file[name]
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = self._stack.enter_context(safe_open(str(self.path / file), framework="pt"))
        return self._handles[file]

    def close(self) -> None:
        """Close the open files."""
        self._stack.close()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
