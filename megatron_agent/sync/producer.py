"""Actor side: this rank's Megatron shards as HF-named full tensors, grouped in load units.

Who sends: one rank per pipeline stage, TP rank 0 of data-parallel replica 0. The other TP
ranks of replica 0 take part in the TP gathers (collective) and drop the result; other replicas
do nothing. Each stage yields its own layers under their global layer numbers; QKV interleave
and gate/up fusion are undone, padded vocabulary rows dropped, and a tied embedding comes once,
from the first stage (the mapping table and exporter in `weights/` do all of that).

A *unit* is the tensors one vLLM module loads from: q/k/v weights (and biases) together,
gate/up together, every other tensor alone. Buckets never split a unit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_agent.models.hf_config import ModelArch
from megatron_agent.weights.export import iter_hf_tensors

Unit = list[tuple[str, torch.Tensor]]

_QKV = re.compile(r"^(model\.layers\.\d+)\.self_attn\.[qkv]_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate|up)_proj\.weight$")


@dataclass(frozen=True)
class SyncRole:
    """This rank's part in a sync."""

    rank: int
    """Global rank."""
    pp_rank: int
    num_stages: int
    in_sending_replica: bool
    """Data-parallel replica 0: takes part in the TP gathers."""
    is_sender: bool
    """Packs and sends its stage's tensors (TP rank 0 of replica 0)."""
    is_leader: bool
    """The first stage's sender: finishes the sync and runs the engine probe."""
    holds_probe: bool
    """Last stage, TP rank 0, replica 0: holds the actor's probe log-probs."""

    @classmethod
    def current(cls) -> SyncRole:
        """The role from Megatron's parallel state."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        replica0 = ps.get_data_parallel_rank() == 0
        tp0 = ps.get_tensor_model_parallel_rank() == 0
        pp_rank = ps.get_pipeline_model_parallel_rank()
        num_stages = ps.get_pipeline_model_parallel_world_size()
        sender = replica0 and tp0
        return cls(
            rank=dist.get_rank(),
            pp_rank=pp_rank,
            num_stages=num_stages,
            in_sending_replica=replica0,
            is_sender=sender,
            is_leader=sender and pp_rank == 0,
            holds_probe=sender and pp_rank == num_stages - 1,
        )


def unit_key(hf_name: str) -> tuple[str, int]:
    """(unit name, number of tensors in the unit) for one HF tensor name."""
    m = _QKV.match(hf_name)
    if m:
        return f"{m.group(1)}.qkv", 0  # size from the architecture, see `_unit_size`
    m = _GATE_UP.match(hf_name)
    if m:
        return f"{m.group(1)}.gate_up", 2
    return hf_name, 1


def _unit_size(key: str, size: int, arch: ModelArch) -> int:
    return (6 if arch.qkv_bias else 3) if key.endswith(".qkv") else size


@torch.no_grad()
def iter_units(chunks: list, arch: ModelArch, role: SyncRole, *, impl: str = "local") -> Iterator[Unit]:
    """Collective over the TP group of replica 0: this stage's HF tensors in load units.

    Yields on the sender only (other ranks run the gathers and yield nothing). Tensors keep the
    model's dtype; packing casts them to the rollout dtype. A unit is yielded as soon as its
    last member is produced, so at most one layer's pending tensors are held.
    """
    if not role.in_sending_replica:
        return
    pending: dict[str, Unit] = {}
    for name, tensor in iter_hf_tensors(chunks, arch, impl=impl):
        if not role.is_sender:  # a TP peer: it took part in the gather; the sender sends
            continue
        key, size = unit_key(name)
        unit = pending.setdefault(key, [])
        unit.append((name, tensor))
        if len(unit) == _unit_size(key, size, arch):
            yield pending.pop(key)
    if pending:
        raise AssertionError(f"incomplete load units at the end of the stage: {sorted(pending)}")
