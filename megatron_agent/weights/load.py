"""Load HF safetensors into this rank's Megatron model chunks, one parameter at a time.

Every rank reads only the HF tensors its own parameters need (through the memory map) and
copies its TP shard in. Before anything is read, the checkpoint's tensor names are checked
against the mapping table: a missing or unexpected tensor is an error that names it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_agent.models.hf_config import ModelArch, padded_vocab_size
from megatron_agent.weights.hf_io import HFCheckpointReader
from megatron_agent.weights.mapping import (
    ParamRule,
    all_hf_names,
    global_rules,
    hf_to_full,
    layer_rules,
    shard,
)

# Names some HF checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatchError(ValueError):
    """The HF checkpoint's tensors do not match what the architecture needs."""


def chunk_param_rules(chunk, arch: ModelArch, impl: str) -> Iterator[tuple[str, ParamRule, int | None]]:
    """(local Megatron name, rule, global layer index or None) for every parameter of a chunk.

    Layer names use the chunk-local index Megatron gives them; the HF side uses the global
    layer number, read from each layer module (correct under PP and VPP).
    """
    params = dict(chunk.named_parameters())
    for rule in global_rules(arch):
        if rule.megatron in params:
            yield rule.megatron, rule, None
    if arch.tied_embeddings and "output_layer.weight" in params:
        # Last pipeline stage of a tied model keeps its own copy of the embedding.
        yield (
            "output_layer.weight",
            ParamRule("output_layer.weight", ("model.embed_tokens.weight",), "vocab"),
            None,
        )
    for local_index, layer in enumerate(chunk.decoder.layers):
        global_index = layer.layer_number - 1
        for rule in layer_rules(arch, impl):
            local_name = rule.megatron.format(i=local_index)
            if local_name not in params:
                raise AssertionError(f"mapping table names {local_name}, which the model does not have")
            yield local_name, rule, global_index


def check_checkpoint_names(reader: HFCheckpointReader, arch: ModelArch) -> None:
    """Raise `CheckpointMismatchError` naming missing and unexpected tensors."""
    present = {n for n in reader.names() if not n.endswith(_IGNORED_SUFFIXES)}
    expected = set(all_hf_names(arch))
    if arch.tied_embeddings and "lm_head.weight" in present:
        # Some tied checkpoints store the shared matrix twice; accept it only if identical.
        if not torch.equal(reader.get("lm_head.weight"), reader.get("model.embed_tokens.weight")):
            raise CheckpointMismatchError(
                f"{reader.path}: tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight"
            )
        present.discard("lm_head.weight")
    missing = sorted(expected - present)
    unexpected = sorted(present - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            parts.append(
                f"unexpected tensors: {', '.join(unexpected[:10])}{' ...' if len(unexpected) > 10 else ''}"
            )
        raise CheckpointMismatchError(
            f"{reader.path} does not match {arch.architecture}: " + "; ".join(parts)
        )


@torch.no_grad()
def load_hf_weights(chunks: list, arch: ModelArch, model_path: str | Path, *, impl: str = "local") -> int:
    """Copy an HF checkpoint into this rank's model chunks. Returns the number of parameters set."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    if arch.num_query_groups % tp_size:
        raise ValueError(f"num_key_value_heads={arch.num_query_groups} is not divisible by tp={tp_size}")
    padded = padded_vocab_size(arch.vocab_size, tp_size)
    num_set = 0
    with HFCheckpointReader(model_path) as reader:
        check_checkpoint_names(reader, arch)
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            seen = set()
            for local_name, rule, layer in chunk_param_rules(chunk, arch, impl):
                _, hf_names = rule.fill(layer)
                full = hf_to_full(rule, [reader.get(n) for n in hf_names], arch, padded)
                piece = shard(rule, full, tp_rank, tp_size)
                param = params[local_name]
                if piece.shape != param.shape:
                    raise CheckpointMismatchError(
                        f"{'+'.join(hf_names)} gives shape {tuple(piece.shape)} for {local_name}, "
                        f"the model has {tuple(param.shape)}"
                    )
                param.copy_(piece)
                # safetensors tensors are views of the file's memory map: closing the files
                # after each parameter keeps the resident set near one parameter, not the model.
                del full, piece
                reader.close()
                seen.add(local_name)
                num_set += 1
            unset = sorted(set(params) - seen)
            if unset:
                raise AssertionError(f"parameters not covered by the mapping table: {unset}")
    return num_set
