"""Streaming writes of HF safetensors checkpoints, sharded by size, one tensor at a time.

The tensors to write are planned up front (name, shape, dtype, in writing order), so every
shard's header can be written before its data and each tensor goes to disk as it arrives:
memory stays at one tensor, whatever `max_shard_size`. With more than one shard,
`model.safetensors.index.json` is written as transformers expects. The data written is flushed
to disk on a second thread while writing goes on (every `FLUSH_BYTES`), so closing a shard
waits only for its last part.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_agent.weights.hf_io import INDEX_FILE, SINGLE_FILE

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
FLUSH_BYTES = 128 << 20
"""Bytes written between two background flushes of the open shard."""

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str | int) -> int:
    """Bytes in a size like '5GB', '500MB', '2GiB' or a plain integer."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit (KB, MB, GB, MiB, GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to be written."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        """Size on disk."""
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split specs, in order, into shards of at most `max_shard_bytes` (a bigger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.num_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.num_bytes
    return shards


def _header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        entries[spec.name] = {
            "dtype": _ST_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.num_bytes],
        }
        offset += spec.num_bytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


class ShardedSafetensorsWriter:
    """Write planned tensors, in order, into size-limited safetensors shards in `out_dir`."""

    def __init__(self, out_dir: str | Path, specs: list[TensorSpec], max_shard_bytes: int, *, metadata=None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in the write plan")
        for s in specs:
            if s.dtype not in _ST_DTYPES:
                raise ValueError(f"{s.name}: dtype {s.dtype} cannot be written to safetensors")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._shards = plan_shards(specs, max_shard_bytes)
        num = len(self._shards)
        self._files = (
            [SINGLE_FILE] if num == 1 else [f"model-{i + 1:05d}-of-{num:05d}.safetensors" for i in range(num)]
        )
        self._metadata = metadata or {"format": "pt"}
        self._queue = [(i, spec) for i, shard in enumerate(self._shards) for spec in shard]
        self._next = 0
        self._open_index = -1
        self._stream = None
        self._flusher = ThreadPoolExecutor(1)
        self._flush: Future | None = None
        self._unflushed = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor (raises if `name`, shape or dtype differ from the plan)."""
        if self._next >= len(self._queue):
            raise ValueError(f"{name}: all planned tensors are already written")
        shard_index, spec = self._queue[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"expected {spec.name} {spec.shape} {spec.dtype} next, got {name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        if shard_index != self._open_index:
            self._close_stream()
            self._stream = open(self.out_dir / self._files[shard_index], "wb")
            self._stream.write(_header(self._shards[shard_index], self._metadata))
            self._open_index = shard_index
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._stream.write(memoryview(data.view(torch.uint8).numpy()))
        self._next += 1
        self._unflushed += spec.num_bytes
        if self._unflushed >= FLUSH_BYTES and (self._flush is None or self._flush.done()):
            self._wait_flush()
            self._stream.flush()
            self._flush = self._flusher.submit(os.fdatasync, self._stream.fileno())
            self._unflushed = 0

    def _wait_flush(self) -> None:
        if self._flush is not None:
            flush, self._flush = self._flush, None
            flush.result()  # a failed background flush is an error here

    def _close_stream(self) -> None:
        if self._stream is not None:
            try:
                self._wait_flush()
                self._stream.flush()
                os.fsync(self._stream.fileno())  # durable before the caller renames the folder into place
            finally:
                self._stream.close()
                self._stream = None
                self._unflushed = 0

    def close(self) -> list[str]:
        """Finish the last shard and write the index (several shards); returns the file names."""
        self._close_stream()
        self._flusher.shutdown()
        if self._next != len(self._queue):
            missing = [spec.name for _, spec in self._queue[self._next :]]
            raise ValueError(f"{len(missing)} planned tensors were not written, first: {missing[0]}")
        if len(self._files) > 1:
            total = sum(s.num_bytes for shard in self._shards for s in shard)
            weight_map = {s.name: self._files[i] for i, shard in enumerate(self._shards) for s in shard}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return list(self._files)
