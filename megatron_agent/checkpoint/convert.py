"""Streaming HF <-> Megatron checkpoint conversion (the library behind tools/convert).

HF -> Megatron: Megatron describes the target layout itself (meta-device chunks, their sharded
state dict); each parameter is produced from the HF safetensors only when the writer reaches it
(`lazy_save`), through the mapping table (`hf_to_full`, `shard`). One process writes a TP1PP1
layout; under torchrun every rank writes its own shards of the requested TP/PP/VPP layout.

Megatron -> HF: a TP1PP1 meta model names the tensors; they are read from the checkpoint one
group at a time (a global tensor, or one layer), mapped with `full_to_hf` (padded vocabulary
rows dropped) and streamed into size-limited safetensors shards. Both directions keep memory
near one tensor (plus one layer when exporting), not the model size.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_agent.checkpoint.layout import HF_DIR, MODEL_DIR
from megatron_agent.checkpoint.lazy_save import lazy_save, storage_id
from megatron_agent.checkpoint.manifest import BackgroundHasher, verify_manifest
from megatron_agent.checkpoint.meta_model import build_meta_chunks
from megatron_agent.checkpoint.model_io import (
    DTYPE_NAMES,
    arch_to_meta,
    begin_save,
    check_arch,
    discard_on_error,
    finish_save,
    verify_checkpoint,
)
from megatron_agent.errors import InputError
from megatron_agent.models.build import DTYPES, BuildOptions
from megatron_agent.models.hf_config import ModelArch, arch_from_hf_config, load_hf_config, padded_vocab_size
from megatron_agent.weights.export import hf_tensors_from_full, is_tied_copy
from megatron_agent.weights.folders import hf_side_files, publish, staging_dir
from megatron_agent.weights.hf_io import HFCheckpointReader
from megatron_agent.weights.hf_write import ShardedSafetensorsWriter, TensorSpec, parse_size
from megatron_agent.weights.load import check_checkpoint_names, chunk_param_rules
from megatron_agent.weights.mapping import hf_to_full, shard

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# Tensors outside the layers (the vocabulary ones) above this size are written in row blocks of
# about this size, so that the exporter can read them a block at a time.
ROW_BLOCK_BYTES = 64 << 20


def resolve_dtype(requested: str, source: torch.dtype, what: str) -> str:
    """'bf16' or 'fp32' for --dtype (`auto`: the source's dtype, which must be one of those)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"--dtype {requested!r}: choose auto, {', '.join(sorted(DTYPES))}")
        return requested
    if source not in DTYPE_NAMES:
        raise ValueError(f"{what} is {source}; pass --dtype bf16 or --dtype fp32 to convert it")
    return DTYPE_NAMES[source]


def hf_to_megatron(
    hf_dir: str | Path,
    out: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    dtype: str = "auto",
    overwrite: bool = False,
) -> dict:
    """Collective: convert an HF folder into a checkpoint at `out`; returns its meta.json content.

    Call after `init_model_parallel(tp, pp, vpp)` (the CLI does). The world size must be tp*pp.
    """
    from megatron.core import parallel_state as ps

    arch = arch_from_hf_config(load_hf_config(hf_dir))
    if dist.get_world_size() != tp * pp:
        raise ValueError(
            f"--tp {tp} --pp {pp} needs {tp * pp} processes, this job has {dist.get_world_size()}: "
            f"run under torchrun --nproc_per_node {tp * pp} (the checkpoint loads at any TP/PP either way)"
        )
    if arch.num_query_groups % tp:
        raise ValueError(f"num_key_value_heads={arch.num_query_groups} is not divisible by --tp {tp}")
    tp_rank = ps.get_tensor_model_parallel_rank()
    padded = padded_vocab_size(arch.vocab_size, tp)
    with HFCheckpointReader(hf_dir) as reader:
        check_checkpoint_names(reader, arch)
        embed = reader.get("model.embed_tokens.weight")
        dtype = resolve_dtype(dtype, embed.dtype, f"{hf_dir}: model.embed_tokens.weight")
        lm_head_stored = arch.tied_embeddings and "lm_head.weight" in reader.names()
        target_dtype = DTYPES[dtype]
        del embed
        chunks = build_meta_chunks(arch, BuildOptions(tp=tp, pp=pp, vpp=vpp, dtype=dtype))
        sources = {}
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            for local_name, rule, layer in chunk_param_rules(chunk, arch, "local"):
                param = params[local_name]
                sources[storage_id(param)] = (local_name, rule, layer, param.shape, param.dtype)

        def produce(sid: int) -> torch.Tensor:
            # The parameter's own dtype: Megatron keeps some (the local spec's norms) in fp32.
            local_name, rule, layer, shape, param_dtype = sources[sid]
            _, hf_names = rule.fill(layer)
            full = hf_to_full(rule, [reader.get(n) for n in hf_names], arch, padded)
            # safetensors tensors are views of the file's memory map, which stays mapped (and its
            # touched pages resident) while the file is open: close it so that only the tensors
            # still in use keep pages in memory.
            reader.close()
            piece = shard(rule, full, tp_rank, tp)
            if piece.shape != shape:
                raise ValueError(
                    f"{'+'.join(hf_names)} gives {tuple(piece.shape)} for {local_name}, expected {tuple(shape)}"
                )
            # Values are rounded to the conversion dtype even where Megatron stores the parameter
            # in fp32 (the local spec's norms), so a bf16 checkpoint holds bf16 weights only.
            piece = piece.to(target_dtype).to(param_dtype).contiguous()
            # A TP piece may be a view into the full tensor: copy it so the full one is freed.
            return piece.clone() if piece.untyped_storage().nbytes() != piece.nbytes else piece

        staging = begin_save(out, [MODEL_DIR], overwrite=overwrite)
        sharded = {f"chunk{i}": _in_row_blocks(chunk.sharded_state_dict()) for i, chunk in enumerate(chunks)}
        # Each tensor file is hashed and synced on other threads while the next one is written.
        with discard_on_error(staging), BackgroundHasher() as hasher:
            lazy_save(sharded, staging / MODEL_DIR, produce, hasher)
            digests = hasher.digests(staging)
    meta = {
        "arch": arch_to_meta(arch),
        "dtype": dtype,
        "saved_layout": {"tp": tp, "pp": pp, "vpp": vpp},
        "contents": [MODEL_DIR, HF_DIR],
        "hf_lm_head_stored": lm_head_stored,
        "source": str(hf_dir),
        "converted_by": "hf_to_megatron",
    }
    finish_save(staging, out, hf_dir=hf_dir, meta=meta, overwrite=overwrite, known_digests=digests)
    return meta


def _in_row_blocks(sharded: dict) -> dict:
    """Replace large non-layer tensors (no prepended axes) by row blocks of ~ROW_BLOCK_BYTES.

    The blocks are irregular shards of the same global tensor (Megatron and DCP load them at any
    layout); a tensor is split on every rank that holds it, replicas included, so all ranks
    describe it the same way.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for name, entry in sharded.items():
        if not isinstance(entry, ShardedTensor) or entry.prepend_axis_num or entry.data.dim() < 1:
            out[name] = entry
            continue
        row_bytes = entry.data[0].numel() * entry.data.element_size()
        rows = max(1, ROW_BLOCK_BYTES // max(row_bytes, 1))
        if entry.local_shape[0] <= rows:
            out[name] = entry
            continue
        blocks = []
        for start in range(0, entry.local_shape[0], rows):
            piece = entry.data[start : start + rows]
            offset = (entry.global_offset[0] + start, *entry.global_offset[1:])
            blocks.append(
                dataclasses.replace(
                    entry,
                    data=piece,
                    local_shape=tuple(piece.shape),
                    global_offset=offset,
                    axis_fragmentations=None,
                )
            )
        out[name] = blocks
    return out


def _read_request(local_name: str, entry, real: torch.Tensor) -> dict:
    """Sharded tensors that load the checkpoint's values for one parameter into `real`, in place.

    Megatron stacks layers along a prepended axis, and a request for one layer of such a tensor
    must be an irregular shard (no prepended axes, no fragmentation grid) so that it can be read
    alone. Factories (gate/up of the MLP) are built on `real`, so their pieces are views of it.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        pieces = entry.build_fn(entry.key, real, entry.replica_id, None)
    elif isinstance(entry, ShardedTensor):
        pieces = [dataclasses.replace(entry, data=real)]
    else:
        raise AssertionError(f"unexpected sharded entry {type(entry).__name__} for {local_name}")
    request = {}
    for j, piece in enumerate(pieces):
        shape = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
        request[f"{local_name}.{j}"] = ShardedTensor(
            key=piece.key,
            data=piece.data.view(shape),
            dtype=piece.dtype,
            local_shape=shape,
            global_shape=piece.global_shape,
            global_offset=piece.global_offset,
            axis_fragmentations=None,
            replica_id=piece.replica_id,
            prepend_axis_num=0,
            allow_shape_mismatch=piece.allow_shape_mismatch,
        )
    return request


def _export_groups(chunk, arch: ModelArch, params: dict) -> list[list[tuple[str, object, int | None]]]:
    """(local name, rule, layer) in export order, grouped for reading: each global tensor alone,
    then whole layers, as many consecutive layers per group as fit in the largest tensor's size
    (fewer, larger reads; peak memory stays about twice the largest tensor).
    """
    layers: dict[int, list] = {}
    groups: list[list] = []
    for local_name, rule, layer in chunk_param_rules(chunk, arch, "local"):
        if is_tied_copy(arch, local_name):
            continue
        m = _LAYER.match(local_name)
        if m is None:
            groups.append([(local_name, rule, layer)])
        else:
            layers.setdefault(int(m.group(1)), []).append((local_name, rule, layer))

    def nbytes(entries):
        return sum(params[n].numel() * params[n].element_size() for n, _, _ in entries)

    entries = [e for grp in groups for e in grp] + [e for lay in layers.values() for e in lay]
    budget = max(nbytes([e]) for e in entries)
    merged: list[list] = []
    for index in sorted(layers):
        if merged and nbytes(merged[-1]) + nbytes(layers[index]) <= budget:
            merged[-1].extend(layers[index])
        else:
            merged.append(list(layers[index]))
    # Embedding first, then the layers, then the final norm and output layer.
    return groups[:1] + merged + groups[1:]


CRITIC_MODEL_DIR = "critic/model"
"""Where a whole-run checkpoint of a gae run keeps the critic's weights (train/megatron_worker.py)."""
VALUE_HEAD = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}
"""The critic's value head and its name in HF's `*ForTokenClassification` (num_labels=1)."""


def megatron_to_hf(
    ckpt_dir: str | Path,
    out: str | Path,
    *,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    verify: bool = True,
    critic: bool = False,
) -> list[str]:
    """Export a checkpoint (any saved layout) to an HF folder; returns the weight file names.

    Runs on one process (after `init_model_parallel(1, 1)`). The output is written to a staging
    folder and renamed to `out` when complete. `critic=True` exports the checkpoint's critic (a
    gae run's) instead of the actor: an HF `<Family>ForTokenClassification` with one label, its
    `score` layer the value head, whose logits are the critic's values.
    """

    if dist.get_world_size() != 1:
        raise ValueError("megatron_to_hf runs on one process (it streams; more ranks would not help)")
    ckpt_dir = Path(ckpt_dir)
    if Path(out).exists() and not overwrite:
        raise FileExistsError(f"{out} exists; remove it or pass overwrite=True (--overwrite)")
    # Missing or truncated files fail now; the checksums are verified on a second thread while
    # the export runs, and the output is published only if they match.
    meta = verify_checkpoint(ckpt_dir, hashes=False)
    checksums = ThreadPoolExecutor(1).submit(verify_manifest, ckpt_dir) if verify else None
    arch = arch_from_hf_config(load_hf_config(ckpt_dir / HF_DIR))
    check_arch(meta, arch, str(ckpt_dir))
    out_dtype = DTYPES[resolve_dtype(dtype, DTYPES[meta["dtype"]], f"{ckpt_dir}")]
    model_dir = ckpt_dir / (CRITIC_MODEL_DIR if critic else MODEL_DIR)
    if critic and not model_dir.is_dir():
        raise InputError(
            f"{ckpt_dir} holds no critic ({CRITIC_MODEL_DIR}): only whole-run checkpoints of a run with "
            "algorithm.adv_estimator=gae have one"
        )
    chunk = (_meta_critic_chunk if critic else build_meta_chunks)(
        arch, BuildOptions(tp=1, pp=1, dtype=meta["dtype"])
    )[0]
    params = dict(chunk.named_parameters())
    sharded = chunk.sharded_state_dict()
    groups = _export_groups(chunk, arch, params)
    if critic:  # the transformer, then the value head as `score`
        groups = [[e for e in g if e[0] not in VALUE_HEAD] for g in groups]
        groups = [g for g in groups if g] + [[(name, None, None) for name in VALUE_HEAD]]
    lm_head_copy = bool(meta.get("hf_lm_head_stored")) and not critic
    specs = []
    for group in groups:
        for local_name, rule, layer in group:
            for name, t in _hf_tensors(local_name, rule, layer, params[local_name], arch):
                specs.append(TensorSpec(name, tuple(t.shape), out_dtype))
                if name == "model.embed_tokens.weight" and lm_head_copy:
                    specs.append(TensorSpec("lm_head.weight", tuple(t.shape), out_dtype))
    staging = staging_dir(out)
    try:
        writer = ShardedSafetensorsWriter(staging, specs, parse_size(max_shard_size))
        for group in groups:
            _export_group(group, model_dir, params, sharded, arch, writer, out_dtype, lm_head_copy)
        files = writer.close()
        for p in hf_side_files(ckpt_dir / HF_DIR):
            shutil.copy2(p, staging / p.name)
        _set_config_dtype(staging / "config.json", out_dtype)
        if critic:
            _as_value_model_config(staging / "config.json")
        if checksums is not None:
            checksums.result()
        publish(staging, out, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return files


def _export_group(group, model_dir, params, sharded, arch, writer, out_dtype, lm_head_copy) -> None:
    """Read one group of parameters from the checkpoint and write their HF tensors.

    A function of its own so that every tensor of the group is freed before the next is read.
    """
    from megatron.core import dist_checkpointing

    reals, request = {}, {}
    for local_name, _, _ in group:
        reals[local_name] = torch.empty(params[local_name].shape, dtype=params[local_name].dtype)
        request.update(_read_request(local_name, sharded[local_name], reals[local_name]))
    dist_checkpointing.load(request, str(model_dir), validate_access_integrity=False)
    del request
    for local_name, rule, layer in group:
        for name, tensor in _hf_tensors(local_name, rule, layer, reals.pop(local_name), arch):
            writer.write(name, tensor.to(out_dtype))
            if name == "model.embed_tokens.weight" and lm_head_copy:
                writer.write("lm_head.weight", tensor.to(out_dtype))


def _hf_tensors(local_name: str, rule, layer, full: torch.Tensor, arch: ModelArch):
    """(HF name, tensor) pairs of one full Megatron parameter: the mapping table's, or the value
    head's (`rule` None)."""
    if rule is None:
        return [(VALUE_HEAD[local_name], full)]
    return hf_tensors_from_full(rule, layer, full, arch)


def _meta_critic_chunk(arch: ModelArch, opts: BuildOptions) -> list:
    """The critic's TP1PP1 chunk on the meta device (models/value_model.py's layout)."""
    from megatron_agent.models.value_model import ValueHead

    chunks = build_meta_chunks(dataclasses.replace(arch, tied_embeddings=False), opts)
    with torch.device("meta"):
        chunks[0].output_layer = ValueHead(arch.hidden_size, DTYPES[opts.dtype], "meta")
    return chunks


def _as_value_model_config(path: Path) -> None:
    """config.json of a `<Family>ForTokenClassification` with one label: the critic as HF loads it."""
    cfg = json.loads(path.read_text())
    cfg["architectures"] = [
        a.replace("ForCausalLM", "ForTokenClassification") for a in cfg.get("architectures", [])
    ]
    cfg["num_labels"], cfg["id2label"], cfg["label2id"] = 1, {"0": "value"}, {"value": 0}
    cfg["problem_type"], cfg["classifier_dropout"] = "regression", 0.0
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """Record the written dtype in config.json (left byte-identical when it already says so)."""
    cfg = json.loads(path.read_text())
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
    if all(cfg.get(k) == name for k in keys):
        return
    for k in keys:
        cfg[k] = name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
