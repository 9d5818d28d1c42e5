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
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_agent.checkpoint.layout import HF_DIR, MODEL_DIR, hf_side_files, publish, staging_dir
from megatron_agent.checkpoint.lazy_save import lazy_save, storage_id
from megatron_agent.checkpoint.meta_model import build_meta_chunks
from megatron_agent.checkpoint.model_io import (
    DTYPE_NAMES,
    arch_to_meta,
    begin_save,
    check_arch,
    finish_save,
    verify_checkpoint,
)
from megatron_agent.models.build import DTYPES, BuildOptions
from megatron_agent.models.hf_config import ModelArch, arch_from_hf_config, load_hf_config, padded_vocab_size
from megatron_agent.weights.export import hf_tensors_from_full, is_tied_copy
from megatron_agent.weights.hf_io import HFCheckpointReader
from megatron_agent.weights.hf_write import ShardedSafetensorsWriter, TensorSpec, parse_size
from megatron_agent.weights.load import check_checkpoint_names, chunk_param_rules
from megatron_agent.weights.mapping import hf_to_full, shard

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


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
        del embed
        torch_dtype = DTYPES[dtype]
        chunks = build_meta_chunks(arch, BuildOptions(tp=tp, pp=pp, vpp=vpp, dtype=dtype))
        sources = {}
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            for local_name, rule, layer in chunk_param_rules(chunk, arch, "local"):
                sources[storage_id(params[local_name])] = (local_name, rule, layer, params[local_name].shape)

        def produce(sid: int) -> torch.Tensor:
            local_name, rule, layer, shape = sources[sid]
            _, hf_names = rule.fill(layer)
            full = hf_to_full(rule, [reader.get(n) for n in hf_names], arch, padded)
            piece = shard(rule, full, tp_rank, tp)
            if piece.shape != shape:
                raise ValueError(
                    f"{'+'.join(hf_names)} gives {tuple(piece.shape)} for {local_name}, expected {tuple(shape)}"
                )
            piece = piece.to(torch_dtype).contiguous()
            # A TP piece may be a view into the full tensor: copy it so the full one is freed.
            return piece.clone() if piece.untyped_storage().nbytes() != piece.nbytes else piece

        staging = begin_save(out, [MODEL_DIR])
        sharded = {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
        lazy_save(sharded, staging / MODEL_DIR, produce)
    meta = {
        "arch": arch_to_meta(arch),
        "dtype": dtype,
        "saved_layout": {"tp": tp, "pp": pp, "vpp": vpp},
        "contents": [MODEL_DIR, HF_DIR],
        "hf_lm_head_stored": lm_head_stored,
        "source": str(hf_dir),
        "converted_by": "hf_to_megatron",
    }
    finish_save(staging, out, hf_dir=hf_dir, meta=meta, overwrite=overwrite)
    return meta


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


def _export_groups(chunk, arch: ModelArch) -> list[list[tuple[str, object, int | None]]]:
    """(local name, rule, layer) in export order, grouped: each global tensor alone, then per layer."""
    groups: list[list] = []
    layer_of: dict[int, list] = {}
    for local_name, rule, layer in chunk_param_rules(chunk, arch, "local"):
        if is_tied_copy(arch, local_name):
            continue
        m = _LAYER.match(local_name)
        if m is None:
            groups.append([(local_name, rule, layer)])
        else:
            if int(m.group(1)) not in layer_of:
                layer_of[int(m.group(1))] = []
                groups.append(layer_of[int(m.group(1))])
            layer_of[int(m.group(1))].append((local_name, rule, layer))
    return groups


def megatron_to_hf(
    ckpt_dir: str | Path,
    out: str | Path,
    *,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    verify: bool = True,
) -> list[str]:
    """Export a checkpoint (any saved layout) to an HF folder; returns the weight file names.

    Runs on one process (after `init_model_parallel(1, 1)`). The output is written to a staging
    folder and renamed to `out` when complete.
    """
    from megatron.core import dist_checkpointing

    if dist.get_world_size() != 1:
        raise ValueError("megatron_to_hf runs on one process (it streams; more ranks would not help)")
    ckpt_dir = Path(ckpt_dir)
    meta = verify_checkpoint(ckpt_dir, hashes=verify)
    arch = arch_from_hf_config(load_hf_config(ckpt_dir / HF_DIR))
    check_arch(meta, arch, str(ckpt_dir))
    out_dtype = DTYPES[resolve_dtype(dtype, DTYPES[meta["dtype"]], f"{ckpt_dir}")]
    chunk = build_meta_chunks(arch, BuildOptions(tp=1, pp=1, dtype=meta["dtype"]))[0]
    params = dict(chunk.named_parameters())
    sharded = chunk.sharded_state_dict()
    groups = _export_groups(chunk, arch)
    specs = []
    for group in groups:
        for local_name, rule, layer in group:
            for name, t in hf_tensors_from_full(rule, layer, params[local_name], arch):
                specs.append(TensorSpec(name, tuple(t.shape), out_dtype))
                if name == "model.embed_tokens.weight" and meta.get("hf_lm_head_stored"):
                    specs.append(TensorSpec("lm_head.weight", tuple(t.shape), out_dtype))
    staging = staging_dir(out)
    writer = ShardedSafetensorsWriter(staging, specs, parse_size(max_shard_size))
    for group in groups:
        reals, request = {}, {}
        for local_name, _, _ in group:
            reals[local_name] = torch.empty(params[local_name].shape, dtype=params[local_name].dtype)
            request.update(_read_request(local_name, sharded[local_name], reals[local_name]))
        dist_checkpointing.load(request, str(ckpt_dir / MODEL_DIR), validate_access_integrity=False)
        for local_name, rule, layer in group:
            for name, t in hf_tensors_from_full(rule, layer, reals.pop(local_name), arch):
                writer.write(name, t.to(out_dtype))
                if name == "model.embed_tokens.weight" and meta.get("hf_lm_head_stored"):
                    writer.write("lm_head.weight", t.to(out_dtype))
        del request
    files = writer.close()
    for p in hf_side_files(ckpt_dir / HF_DIR):
        target = staging / p.name
        target.write_bytes(p.read_bytes())
    if out_dtype != DTYPES[meta["dtype"]] or dtype != "auto":
        _set_config_dtype(staging / "config.json", out_dtype)
    publish(staging, out, overwrite=overwrite)
    return files


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    cfg = json.loads(path.read_text())
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    for key in ("torch_dtype", "dtype"):
        if key in cfg or key == "torch_dtype":
            cfg[key] = name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
