"""Where every HF tensor of a pipeline stage lives in the shared-memory buckets, and which rows each TP rank writes.

Used by the CPU path of the sync (`shm_stream.py`): instead of gathering the TP shards through
the process group, every TP rank of the sending replica copies its own shard straight into the
full HF tensors in a shared-memory segment. The layout comes from the one mapping table
(`weights/mapping.py`), never from a second copy of its rules: `unshard` and `full_to_hf` are
applied to small *index* tensors (one id per shard row, or per shard column for row-parallel
layers), which gives, for every row (column) of every HF tensor, the TP rank and shard row it
comes from. QKV interleave, gate/up fusion and vocabulary padding are undone that way, and a
shard's contribution to an HF tensor becomes a few contiguous runs (`Run`).

Every TP rank computes the same plan from the same model structure (shapes only, no data), so
the sender and its peers agree on names, shapes and offsets without exchanging them. The plan
checks that the ranks' runs cover every element of every tensor exactly once, so every byte of a
bucket is rewritten by every sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_agent.models.hf_config import ModelArch
from megatron_agent.sync.buckets import TensorEntry, aligned, dtype_name
from megatron_agent.sync.producer import _unit_size, unit_key
from megatron_agent.weights.export import is_tied_copy, unwrap
from megatron_agent.weights.load import chunk_param_rules
from megatron_agent.weights.mapping import ParamRule, full_to_hf, unshard


@dataclass(frozen=True)
class Run:
    """`length` consecutive rows (dim 0) or columns (dim 1) copied from a shard into an HF tensor."""

    dim: int
    dst: int
    src: int
    length: int


@dataclass
class PlannedTensor:
    """One HF tensor of the stage: its place in a bucket and this rank's runs into it."""

    name: str
    shape: tuple[int, ...]
    chunk: int
    """Index of the model chunk holding the Megatron parameter."""
    param: str
    """Local Megatron parameter name in that chunk."""
    runs: list[Run]
    """What this TP rank copies (empty: another rank writes it all)."""
    offset: int = 0
    """Byte offset inside its bucket."""


@dataclass
class PlannedBucket:
    """One bucket: its tensors (whole load units) and their total aligned size."""

    index: int
    tensors: list[PlannedTensor] = field(default_factory=list)
    nbytes: int = 0

    def entries(self, dtype: torch.dtype) -> list[TensorEntry]:
        """Header entries (checksums still 0)."""
        name, size = dtype_name(dtype), dtype.itemsize
        return [TensorEntry(t.name, t.shape, name, t.offset, _numel(t.shape) * size, 0) for t in self.tensors]


@dataclass
class StagePlan:
    """The stage's buckets and the segment that holds them (two slots reused in turn)."""

    buckets: list[PlannedBucket]
    slot_bytes: int
    dtype: torch.dtype

    @property
    def num_slots(self) -> int:
        """1 when the stage fits in one bucket, else 2 (at most two buckets in flight)."""
        return min(2, len(self.buckets))

    @property
    def segment_bytes(self) -> int:
        """Size of the shared-memory segment."""
        return max(self.slot_bytes * self.num_slots, 1)

    def slot_offset(self, bucket: int) -> int:
        """Byte offset of bucket `bucket`'s slot in the segment."""
        return (bucket % 2) * self.slot_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _split_dim(rule: ParamRule, tp: int) -> int | None:
    """Dimension along which the table splits `rule` over TP (None: replicated), read from `unshard`."""
    if tp == 1:
        return 0
    full = unshard(rule, [torch.zeros(2, 3) for _ in range(tp)])
    if tuple(full.shape) == (2, 3):
        return None
    return 0 if full.shape[0] == 2 * tp else 1


def _runs(hf_ids: torch.Tensor, per_rank: int, rank: int, dim: int) -> list[Run]:
    """Runs of this rank's shard rows inside one HF tensor whose row j comes from id hf_ids[j]."""
    dst = (hf_ids // per_rank == rank).nonzero().flatten()
    if dst.numel() == 0:
        return []
    src = hf_ids[dst] % per_rank
    # A run breaks where either side stops advancing by one.
    breaks = ((dst[1:] - dst[:-1] != 1) | (src[1:] - src[:-1] != 1)).nonzero().flatten() + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), dst.numel()]
    return [Run(dim, int(dst[a]), int(src[a]), b - a) for a, b in zip(starts, ends)]


def tensor_runs(
    rule: ParamRule, layer: int | None, local_shape: tuple[int, ...], arch: ModelArch, tp: int
) -> list[tuple[str, tuple[int, ...], list[list[Run]]]]:
    """(HF name, HF shape, runs of each TP rank) for every HF tensor of one Megatron parameter.

    Raises AssertionError unless the ranks' runs fill every HF tensor exactly once."""
    _, hf_names = rule.fill(layer)
    dim = _split_dim(rule, tp)
    writers = tp if dim is not None else 1  # a replicated tensor is written by TP rank 0 alone
    dim = dim or 0
    n = local_shape[dim]
    ids = [torch.arange(n, dtype=torch.int64) + r * n for r in range(writers)]
    if dim == 1:
        ids = [i.view(1, n) for i in ids]
    full = unshard(rule, ids) if writers > 1 else ids[0]
    out = []
    for name, hf_ids in zip(hf_names, full_to_hf(rule, full, arch), strict=True):
        hf_ids = hf_ids.reshape(-1)
        shape = (hf_ids.numel(), *local_shape[1:]) if dim == 0 else (local_shape[0], hf_ids.numel())
        by_rank = [_runs(hf_ids, n, r, dim) if r < writers else [] for r in range(tp)]
        filled = torch.zeros(hf_ids.numel(), dtype=torch.int64)
        for runs in by_rank:
            for run in runs:
                filled[run.dst : run.dst + run.length] += 1
        if not bool((filled == 1).all()):
            raise AssertionError(f"{name}: the TP ranks' shards do not fill the tensor exactly once")
        out.append((name, shape, by_rank))
    return out


def build_plan(
    chunks: list, arch: ModelArch, impl: str, tp_rank: int, tp: int, bucket_bytes: int, dtype: torch.dtype
) -> StagePlan:
    """This stage's bucket layout and this TP rank's runs (shapes only; the same on every TP rank)."""
    size = dtype.itemsize
    units: list[list[PlannedTensor]] = []
    pending: dict[str, list[PlannedTensor]] = {}
    for c, chunk in enumerate(chunks):
        chunk = unwrap(chunk)
        params = dict(chunk.named_parameters())
        for local_name, rule, layer in chunk_param_rules(chunk, arch, impl):
            if is_tied_copy(arch, local_name):
                continue
            local_shape = tuple(params[local_name].shape)
            for name, shape, by_rank in tensor_runs(rule, layer, local_shape, arch, tp):
                key, unit_len = unit_key(name)
                unit = pending.setdefault(key, [])
                unit.append(PlannedTensor(name, shape, c, local_name, by_rank[tp_rank]))
                if len(unit) == _unit_size(key, unit_len, arch):
                    units.append(pending.pop(key))
    if pending:
        raise AssertionError(f"incomplete load units at the end of the stage: {sorted(pending)}")
    buckets: list[PlannedBucket] = []
    for unit in units:
        need = sum(aligned(_numel(t.shape) * size) for t in unit)
        if not buckets or (buckets[-1].nbytes and buckets[-1].nbytes + need > bucket_bytes):
            buckets.append(PlannedBucket(len(buckets)))
        bucket = buckets[-1]
        for t in unit:
            t.offset = bucket.nbytes
            bucket.tensors.append(t)
            bucket.nbytes += aligned(_numel(t.shape) * size)
    slot = max((b.nbytes for b in buckets), default=0)
    return StagePlan(buckets, slot, dtype)


@torch.no_grad()
def write_bucket(
    bucket: PlannedBucket, plan: StagePlan, params: list[dict], segment_u8: torch.Tensor
) -> None:
    """Copy this rank's runs of every tensor of `bucket` into its slot of the segment (cast to the plan's dtype).

    `params[c]` maps local parameter names of chunk c to tensors."""
    base = plan.slot_offset(bucket.index)
    size = plan.dtype.itemsize
    for t in bucket.tensors:
        if not t.runs:
            continue
        start = base + t.offset
        dst = segment_u8[start : start + _numel(t.shape) * size].view(plan.dtype).view(t.shape)
        src = params[t.chunk][t.param].detach()
        for run in t.runs:
            if run.dim == 0:
                dst[run.dst : run.dst + run.length].copy_(src[run.src : run.src + run.length])
            else:
                dst[:, run.dst : run.dst + run.length].copy_(src[:, run.src : run.src + run.length])
