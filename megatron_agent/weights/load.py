"""Load HF safetensors into this rank's Megatron model chunks, one parameter at a time, in place.

Each parameter is filled directly from the parts of the HF tensors that its TP rank keeps: row
ranges are read through safetensors' slice API (only those rows' pages of the file are touched),
and fused parameters (QKV interleaved per query group, gate/up, the padded vocabulary) are
assembled in the parameter itself, so no full fused tensor is ever materialised and a rank's
memory stays near its own shard. Only splits along dim 1 (row-parallel layers at TP > 1) touch
the whole HF tensor, whose pages are released when the file is closed after the parameter.

Before anything is read, the checkpoint's tensor names are checked against the mapping table
(a missing tensor is an error naming it and the parameter it feeds); after the load every
parameter must have been filled, or `UnfilledParameterError` names the ones that were not. A
model built without random initialisation (`build_model_chunks(initialize=False)`) relies on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_agent.errors import InputError
from megatron_agent.models.hf_config import ModelArch
from megatron_agent.weights.hf_io import HFCheckpointReader
from megatron_agent.weights.mapping import ParamRule, all_hf_names, global_rules, layer_rules

# Names some HF checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatchError(InputError):
    """The HF checkpoint's tensors do not match what the architecture needs."""


class UnfilledParameterError(CheckpointMismatchError):
    """A load left model parameters unfilled (they would hold uninitialised memory)."""


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
            feeds = _megatron_name_by_hf(arch)
            named = [f"{n} (for {feeds[n]}, left unfilled)" for n in missing[:10]]
            parts.append(f"missing tensors: {', '.join(named)}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            parts.append(
                f"unexpected tensors: {', '.join(unexpected[:10])}{' ...' if len(unexpected) > 10 else ''}"
            )
        raise CheckpointMismatchError(
            f"{reader.path} does not match {arch.architecture}: " + "; ".join(parts)
        )


def _megatron_name_by_hf(arch: ModelArch) -> dict[str, str]:
    """HF tensor name -> the Megatron parameter it feeds (global layer numbering)."""
    feeds = {h: rule.megatron for rule in global_rules(arch) for h in rule.hf}
    for i in range(arch.num_layers):
        for rule in layer_rules(arch):
            megatron, hf_names = rule.fill(i)
            feeds.update(dict.fromkeys(hf_names, megatron))
    return feeds


@torch.no_grad()
def load_hf_weights(
    chunks: list, arch: ModelArch, model_path: str | Path, *, impl: str = "local", own_prefixes: tuple = ()
) -> int:
    """Fill this rank's model chunks from an HF checkpoint, in place. Returns the parameters set.

    Every parameter of every chunk must be filled, except those under `own_prefixes` (which the
    caller initialises itself: a value model's `output_layer.`): `CheckpointMismatchError` names
    missing, unexpected or wrongly shaped tensors before or while reading,
    `UnfilledParameterError` names parameters the mapping table does not cover.
    """
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    if arch.num_query_groups % tp_size:
        raise ValueError(f"num_key_value_heads={arch.num_query_groups} is not divisible by tp={tp_size}")
    filled: set[int] = set()
    with HFCheckpointReader(model_path) as reader:
        check_checkpoint_names(reader, arch)
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            for local_name, rule, layer in chunk_param_rules(chunk, arch, impl):
                if local_name.startswith(own_prefixes) and own_prefixes:
                    continue
                _, hf_names = rule.fill(layer)
                param = params[local_name]
                concrete = ParamRule(local_name, hf_names, rule.kind)  # errors name real tensors
                fill_from_hf(param, concrete, [reader.get_slice(n) for n in hf_names], arch, tp_rank, tp_size)
                # The slices are views of the file's memory map, resident while it is open:
                # closing the files after each parameter keeps that near one tensor.
                reader.close()
                filled.add(id(param))
    unfilled = [
        f"chunk{i}.{name}"
        for i, chunk in enumerate(chunks)
        for name, param in chunk.named_parameters()
        if id(param) not in filled
        and param.numel()  # an empty tensor holds no stale memory
        and not (own_prefixes and name.startswith(own_prefixes))
    ]
    if unfilled:
        raise UnfilledParameterError(
            f"loading {model_path} left {len(unfilled)} parameter(s) unfilled: {', '.join(unfilled[:10])}"
            f"{' ...' if len(unfilled) > 10 else ''}; the mapping table (weights/mapping.py) has no rule "
            "for them, so they would hold uninitialised memory"
        )
    return len(filled)


def expected_hf_shapes(rule: ParamRule, shape: torch.Size, arch: ModelArch, tp_size: int) -> list[tuple]:
    """The full HF tensor shapes that a TP shard of `shape` is cut from, in `rule.hf` order."""
    s = tuple(shape)
    if rule.kind == "replicated":
        return [s]
    if rule.kind == "column":
        return [(s[0] * tp_size, *s[1:])]
    if rule.kind == "row":
        return [(s[0], s[1] * tp_size, *s[2:])]
    if rule.kind == "vocab":
        return [(arch.vocab_size, *s[1:])]
    if rule.kind == "gate_up":
        return [(s[0] // 2 * tp_size, *s[1:])] * 2
    if rule.kind == "qkv":
        groups, per_group, d = arch.num_query_groups, arch.heads_per_group, arch.head_dim
        kv = (groups * d, *s[1:])
        return [(groups * per_group * d, *s[1:]), kv, kv]
    raise AssertionError(f"unknown rule kind {rule.kind}")


def fill_from_hf(
    dst: torch.Tensor, rule: ParamRule, slices: list, arch: ModelArch, tp_rank: int, tp_size: int
) -> None:
    """Copy TP rank `tp_rank`'s piece of `rule`'s HF tensors into `dst` (its Megatron shard).

    `slices` are safetensors slices (or tensors) of the HF tensors in `rule.hf` order. The
    values equal `mapping.shard(rule, mapping.hf_to_full(...))` cast to `dst`'s dtype; padded
    vocabulary rows become zeros.
    """
    names = "+".join(rule.hf)
    for hf_name, src, want in zip(rule.hf, slices, expected_hf_shapes(rule, dst.shape, arch, tp_size)):
        got = tuple(src.get_shape() if hasattr(src, "get_shape") else src.shape)
        if got != want:
            raise CheckpointMismatchError(
                f"{hf_name} has shape {got}; {rule.megatron} of shape {tuple(dst.shape)} at tp={tp_size} "
                f"needs {want}"
            )
    kind, r = rule.kind, tp_rank
    if kind == "replicated":
        dst.copy_(slices[0][:])
    elif kind == "column":
        n = dst.shape[0]
        dst.copy_(slices[0][r * n : (r + 1) * n])
    elif kind == "row":
        n = dst.shape[1]
        dst.copy_(slices[0][:, r * n : (r + 1) * n])
    elif kind == "vocab":
        start = r * dst.shape[0]
        num_real = max(0, min(dst.shape[0], arch.vocab_size - start))
        if num_real:
            dst[:num_real].copy_(slices[0][start : start + num_real])
        dst[num_real:].zero_()
    elif kind == "gate_up":
        n = dst.shape[0] // 2
        dst[:n].copy_(slices[0][r * n : (r + 1) * n])
        dst[n:].copy_(slices[1][r * n : (r + 1) * n])
    elif kind == "qkv":
        # Megatron's layout: per query group, [q heads of the group; k; v] (see mapping.py).
        num_local = arch.num_query_groups // tp_size
        per_group, d = arch.heads_per_group, arch.head_dim
        tail = tuple(dst.shape[1:])
        grouped = dst.view(num_local, (per_group + 2) * d, *tail)
        first = r * num_local
        q = slices[0][first * per_group * d : (first + num_local) * per_group * d]
        k = slices[1][first * d : (first + num_local) * d]
        v = slices[2][first * d : (first + num_local) * d]
        grouped[:, : per_group * d].copy_(q.reshape(num_local, per_group * d, *tail))
        grouped[:, per_group * d : (per_group + 1) * d].copy_(k.reshape(num_local, d, *tail))
        grouped[:, (per_group + 1) * d :].copy_(v.reshape(num_local, d, *tail))
    else:
        raise AssertionError(f"unknown rule kind {kind} for {names}")
