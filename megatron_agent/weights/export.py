"""Megatron -> HF tensors: gather tensor-parallel shards and map names with the one table.

`iter_hf_tensors` walks this rank's live model chunks and yields (HF name, tensor) one at a time,
TP shards gathered with `mapping.unshard` and split into HF tensors with `mapping.full_to_hf`
(padded vocabulary rows dropped). The checkpoint exporter (`checkpoint.convert`) and the rollout
weight sync use the same functions, so they can never disagree with loading.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_agent.models.hf_config import ModelArch
from megatron_agent.weights.load import chunk_param_rules
from megatron_agent.weights.mapping import ParamRule, full_to_hf, unshard


def unwrap(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def is_tied_copy(arch: ModelArch, local_name: str) -> bool:
    """True for the last pipeline stage's copy of a tied embedding (never exported)."""
    return arch.tied_embeddings and local_name == "output_layer.weight"


def hf_tensors_from_full(
    rule: ParamRule, layer: int | None, full: torch.Tensor, arch: ModelArch
) -> list[tuple[str, torch.Tensor]]:
    """The HF (name, tensor) pairs of one full (TP-gathered) Megatron tensor."""
    _, hf_names = rule.fill(layer)
    return list(zip(hf_names, full_to_hf(rule, full, arch), strict=True))


def gather_tp(rule: ParamRule, local: torch.Tensor, tp_group=None) -> torch.Tensor:
    """The full Megatron tensor from this rank's TP shard (collective over `tp_group`)."""
    import torch.distributed as dist

    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if rule.kind == "replicated" or tp_size == 1:
        return local
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local, group=tp_group)
    return unshard(rule, shards)


@torch.no_grad()
def iter_hf_tensors(
    chunks: list, arch: ModelArch, *, impl: str = "local"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter of this rank's chunks, TP shards gathered.

    Every TP rank of a pipeline stage yields the same tensors (the gather is collective, so all
    TP ranks must iterate together); each pipeline stage yields its own layers; a tied model
    yields `model.embed_tokens.weight` once, from the first stage.
    """
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    for chunk in chunks:
        chunk = unwrap(chunk)
        params = dict(chunk.named_parameters())
        for local_name, rule, layer in chunk_param_rules(chunk, arch, impl):
            if is_tied_copy(arch, local_name):
                continue
            full = gather_tp(rule, params[local_name].detach(), tp_group)
            yield from hf_tensors_from_full(rule, layer, full, arch)
