"""Flat transfer buckets: HF-named tensors packed into one byte buffer with a small header.

A bucket is a byte buffer (CPU memory, shared memory or a CUDA allocation) plus a `BucketHeader`
listing, for every tensor, its name, shape, dtype, byte offset and a checksum of the bytes that
were written. The sender packs whole *units* (the tensors one vLLM module is loaded from, e.g.
q/k/v with their biases) so a bucket never splits a module: vLLM's in-place reload processes a
module only once all its weights arrived in the same call.

Checksums: XXH3-64 on CPU buffers (26 GB/s on one core of the 2-core benchmark machine, where
zlib's CRC-32 runs at 4.5 GB/s and Adler-32 at 3.3 GB/s; CRC-32 is still accepted); on CUDA
buffers, a position-weighted 64-bit integer sum computed on the device (exact, order-independent).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megatron_agent.errors import RunFailure
from megatron_agent.sync.quantizer import wire_dtype

ALIGN = 256  # byte alignment of every tensor in a bucket (any dtype view, CUDA-friendly)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,  # FP8 rollout weights, NVFP4 block scales
    "uint8": torch.uint8,  # NVFP4 rollout weights (two e2m1 per byte)
}


class SyncError(RunFailure):
    """The weight sync failed: a checksum or probe mismatch, or an engine that died or hung."""


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16' or 'float16' for a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(
            f"rollout dtype {dtype} is not supported for weight sync; use one of {list(_DTYPES)}"
        )
    return name


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the bucket alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    checksum: int


@dataclass
class BucketHeader:
    """Everything the engine needs to read a bucket; small and picklable."""

    sync_id: int
    sender: int
    """Global rank of the sending actor rank."""
    index: int
    """Bucket number within this sender's sync (0, 1, ...)."""
    algo: str
    """Checksum algorithm: 'crc32' or 'wsum64'; '' when the sync is not verified."""
    entries: list[TensorEntry] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes used in the buffer (last tensor's end)."""
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    @property
    def payload_bytes(self) -> int:
        """Tensor bytes in the bucket (alignment gaps excluded)."""
        return sum(e.nbytes for e in self.entries)

    @property
    def key(self) -> tuple[int, int]:
        """(sender, index): unique within a sync."""
        return self.sender, self.index

    def names(self) -> list[str]:
        """Tensor names in bucket order."""
        return [e.name for e in self.entries]


def checksum(buf_u8: torch.Tensor, algo: str) -> int:
    """Checksum of a 1-D uint8 tensor with `algo` ('xxh3' or 'crc32' on CPU, 'wsum64' anywhere)."""
    if algo == "xxh3":
        import xxhash

        return xxhash.xxh3_64_intdigest(memoryview(buf_u8.numpy()))
    if algo == "crc32":
        return zlib.crc32(memoryview(buf_u8.numpy()))
    if algo == "wsum64":
        return _weighted_sum64(buf_u8)
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def default_algo(device: torch.device) -> str:
    """The checksum for buffers on `device`."""
    return "xxh3" if device.type == "cpu" else "wsum64"


def _weighted_sum64(buf_u8: torch.Tensor) -> int:
    # Words weighted by (position mod a prime) + 1: a swapped or shifted word changes the sum.
    # Integer arithmetic wraps identically on every device, so sender and engine agree bit-exactly.
    n = buf_u8.numel()
    pad = (-n) % 4
    if pad:
        buf_u8 = torch.cat([buf_u8, buf_u8.new_zeros(pad)])
    words = buf_u8.view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    return int((words * weights).sum().item()) ^ n


def entry_view(buf_u8: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """The tensor of `e` as a view into the bucket buffer (zero-copy)."""
    return buf_u8[e.offset : e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape)


def iter_views(buf_u8: torch.Tensor, header: BucketHeader) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) for every tensor of a bucket."""
    for e in header.entries:
        yield e.name, entry_view(buf_u8, e)


def first_bad_entry(buf_u8: torch.Tensor, header: BucketHeader) -> tuple[TensorEntry, int] | None:
    """(entry, received checksum) of the first tensor whose bytes differ from the sender's, or None."""
    for e in header.entries:
        got = checksum(buf_u8[e.offset : e.offset + e.nbytes], header.algo)
        if got != e.checksum:
            return e, got
    return None


def units_nbytes(unit: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> int:
    """Bucket bytes a unit takes in `dtype` (alignment included)."""
    return sum(aligned(t.numel() * wire_dtype(n, t, dtype).itemsize) for n, t in unit)


class BucketWriter:
    """Packs units into one buffer, converting to the rollout dtype while copying."""

    def __init__(self, buf_u8: torch.Tensor, header: BucketHeader, dtype: torch.dtype):
        self.buf = buf_u8
        self.header = header
        self.dtype = dtype
        self.dtype_name = dtype_name(dtype)
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.used = 0
        self.checksum_s = 0.0

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit in the buffer."""
        return self.used + nbytes <= self.buf.numel()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor in (cast to the rollout dtype) and record its entry and checksum."""
        dtype = wire_dtype(name, tensor, self.dtype)
        nbytes = tensor.numel() * dtype.itemsize
        e = TensorEntry(name, tuple(tensor.shape), dtype_name(dtype), self.used, nbytes, 0)
        entry_view(self.buf, e).copy_(tensor)
        if self.header.algo:
            t0 = time.perf_counter()
            value = checksum(self.buf[e.offset : e.offset + nbytes], self.header.algo)
            self.checksum_s += time.perf_counter() - t0
            e = TensorEntry(e.name, e.shape, e.dtype, e.offset, e.nbytes, value)
        self.header.entries.append(e)
        self.used += aligned(nbytes)
