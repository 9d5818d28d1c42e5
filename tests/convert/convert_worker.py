"""Stages of the conversion tests, run in fresh processes (one process, or 4 gloo ranks by torchrun).

    python tests/convert/convert_worker.py convert WORK     # HF -> Megatron (TP1PP1), error cases
    torchrun --nproc_per_node 4 tests/convert/convert_worker.py reshard WORK   # load/save at TP2PP2
    python tests/convert/convert_worker.py export WORK      # Megatron (saved TP2PP2) -> HF, TP1PP1 load

Each stage writes WORK/<stage>.json with what it measured; tests/convert/test_convert.py asserts.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

MODELS = ("llama_tied", "llama", "qwen2", "qwen3")


def _arch(path):
    from megatron_agent.models.hf_config import arch_from_hf_config, load_hf_config

    return arch_from_hf_config(load_hf_config(path))


def _params_equal_to_hf(chunks, arch, hf_dir, opts) -> list[str]:
    """Names of parameters that differ from the same model loaded straight from HF (empty: all equal)."""
    from megatron_agent.models.build import build_model_chunks
    from megatron_agent.weights.load import load_hf_weights

    ref = build_model_chunks(arch, opts, trainable=False)
    load_hf_weights(ref, arch, hf_dir)
    bad = []
    for a, b in zip(chunks, ref):
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert pa.keys() == pb.keys()
        bad += [n for n in pa if not torch.equal(pa[n], pb[n])]
    return bad


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return ""


def stage_convert(work: Path) -> dict:
    """HF -> Megatron at TP1PP1 on one process; a swapped-QKV conversion; every error case."""
    from megatron_agent.checkpoint import convert
    from megatron_agent.checkpoint.convert import hf_to_megatron
    from megatron_agent.checkpoint.model_io import load_checkpoint
    from megatron_agent.models.build import BuildOptions, build_model_chunks
    from megatron_agent.platform.parallel import init_model_parallel
    from megatron_agent.weights import mapping

    init_model_parallel(1, 1)
    out: dict = {}
    convert.ROW_BLOCK_BYTES = 40_000  # vocabulary tensors (350 x 128 fp32) in 4 blocks, as for big models
    for name in MODELS:
        if not (work / "tp1" / name).exists():  # llama_tied is converted by the CLI test
            hf_to_megatron(work / "hf" / name, work / "tp1" / name)

    # A tied checkpoint that also stores lm_head.weight (some do) is exported the same way.
    from safetensors.torch import load_file, save_file

    dup = work / "hf" / "llama_tied_dup"
    shutil.copytree(work / "hf" / "llama_tied", dup)
    tensors = load_file(dup / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, dup / "model.safetensors", metadata={"format": "pt"})
    hf_to_megatron(dup, work / "tp1" / "llama_tied_dup")

    # The classic GQA bug: q, k, v concatenated instead of interleaved per query group.
    original = mapping._interleave_qkv
    mapping._interleave_qkv = lambda q, k, v, arch: torch.cat([q, k, v], dim=0)
    try:
        hf_to_megatron(work / "hf" / "qwen2", work / "swapped_qkv")
    finally:
        mapping._interleave_qkv = original

    def bad_hf(name, **changes):
        folder = work / "bad_hf" / name
        shutil.copytree(work / "hf" / "llama", folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))
        return folder

    out["unsupported_arch"] = _error(
        lambda: hf_to_megatron(bad_hf("mistral", architectures=["MistralForCausalLM"]), work / "never1")
    )
    out["unsupported_rope"] = _error(
        lambda: hf_to_megatron(
            bad_hf("yarn", rope_scaling={"rope_type": "yarn", "factor": 4.0}), work / "never2"
        )
    )
    out["exists"] = _error(lambda: hf_to_megatron(work / "hf" / "qwen2", work / "tp1" / "qwen2"))
    out["never_written"] = [p.name for p in work.iterdir() if p.name.startswith(("never", ".never"))]

    arch = _arch(work / "hf" / "qwen2")
    chunks = build_model_chunks(arch, BuildOptions(), trainable=False)
    good = work / "tp1" / "qwen2"
    shards = sorted((good / "model").glob("*.distcp"), key=lambda p: -p.stat().st_size)

    def damaged(kind):
        folder = work / "damaged" / kind
        shutil.copytree(good, folder)
        victim = folder / "model" / shards[0].name
        if kind == "missing":
            victim.unlink()
        elif kind == "truncated":
            victim.write_bytes(victim.read_bytes()[:-100])
        elif kind == "altered":
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
        elif kind == "no_manifest":
            (folder / "manifest.json").unlink()
        elif kind == "hf_config_altered":
            (folder / "hf" / "config.json").write_text((folder / "hf" / "config.json").read_text() + " ")
        return folder

    out["victim"] = shards[0].name
    for kind in ("missing", "truncated", "altered", "no_manifest", "hf_config_altered"):
        out[f"damaged_{kind}"] = _error(lambda kind=kind: load_checkpoint(damaged(kind), chunks, arch))
    out["intact_load"] = _error(lambda: load_checkpoint(good, chunks, arch))
    wrong_arch = _arch(work / "hf" / "qwen3")
    out["wrong_arch"] = _error(
        lambda: load_checkpoint(
            good, build_model_chunks(wrong_arch, BuildOptions(), trainable=False), wrong_arch
        )
    )
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(work / "tp1" / "llama" / "model")).read_metadata().state_dict_metadata
    out["vocab_blocks"] = {
        k: len(md[k].chunks) for k in ("embedding.word_embeddings.weight", "output_layer.weight")
    }
    out["meta_qwen3"] = json.loads((work / "tp1" / "qwen3" / "meta.json").read_text())
    return out


def stage_reshard(work: Path) -> dict:
    """4 ranks: load the TP1PP1 checkpoints at TP2PP2 (and TP2PP2VPP2), compare, save, convert at TP2PP2."""
    from megatron_agent.checkpoint.convert import hf_to_megatron
    from megatron_agent.checkpoint.logit_check import check_against_hf
    from megatron_agent.checkpoint.meta_model import build_meta_chunks
    from megatron_agent.checkpoint.model_io import load_checkpoint, model_sharded_state_dict, save_checkpoint
    from megatron_agent.models.build import BuildOptions, build_model_chunks
    from megatron_agent.platform.parallel import init_model_parallel

    out: dict = {"mismatched": {}, "verify": {}, "meta_layout_diff": {}}
    for tp, pp, vpp in ((2, 2, 1), (2, 2, 2)):
        init_model_parallel(tp, pp, vpp)
        opts = BuildOptions(tp=tp, pp=pp, vpp=vpp)
        for name in MODELS if vpp == 1 else ("llama_tied",):
            hf_dir = work / "hf" / name
            arch = _arch(hf_dir)
            chunks = build_model_chunks(arch, opts, trainable=False)
            load_checkpoint(work / "tp1" / name, chunks, arch)
            bad = _params_equal_to_hf(chunks, arch, hf_dir, opts)
            tag = f"{name}@tp{tp}pp{pp}vpp{vpp}"
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, bad)
            out["mismatched"][tag] = sorted({n for g in gathered for n in g})
            # The meta model (used by the streaming converters) must describe the same checkpoint.
            meta_sd = model_sharded_state_dict(build_meta_chunks(arch, opts))
            out["meta_layout_diff"][tag] = _layout_diff(model_sharded_state_dict(chunks), meta_sd)
            if vpp == 1:
                reports = check_against_hf(
                    chunks, hf_dir, arch.vocab_size, torch.float32, tokenizer_dir=hf_dir
                )
                out["verify"][tag] = [dataclasses.asdict(r) for r in reports]
                save_checkpoint(work / "tp2pp2" / name, chunks, arch, hf_dir=hf_dir)
            else:
                save_checkpoint(work / "vpp" / name, chunks, arch, hf_dir=hf_dir)
    init_model_parallel(2, 2)
    from megatron_agent.checkpoint import convert

    convert.ROW_BLOCK_BYTES = 40_000
    hf_to_megatron(work / "hf" / "qwen3", work / "conv_tp2pp2" / "qwen3", tp=2, pp=2)
    return out


def _layout_diff(real_sd: dict, meta_sd: dict) -> list[str]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    def describe(sd):
        apply_factories(sd)
        return sorted(
            (v.key, v.global_shape, v.global_offset, str(v.dtype), str(v.replica_id), v.allow_shape_mismatch)
            for v in nested_values(sd)
            if isinstance(v, ShardedTensor)
        )

    a, b = describe(real_sd), describe(meta_sd)
    return [str(x) for x in sorted(set(a) ^ set(b))]


def stage_export(work: Path) -> dict:
    """Export the TP2PP2-saved (and VPP, and TP2PP2-converted) checkpoints; load them at TP1PP1."""
    from megatron_agent.checkpoint.convert import hf_to_megatron, megatron_to_hf
    from megatron_agent.checkpoint.model_io import load_checkpoint
    from megatron_agent.models.build import BuildOptions, build_model_chunks
    from megatron_agent.platform.parallel import init_model_parallel

    init_model_parallel(1, 1)
    out: dict = {"roundtrip": {}, "tp1_mismatched": {}}
    jobs = [(name, work / "tp2pp2" / name) for name in MODELS if name != "llama_tied"]
    jobs += [
        ("llama_tied@vpp", work / "vpp" / "llama_tied"),
        ("qwen3@converted_tp2pp2", work / "conv_tp2pp2" / "qwen3"),
    ]
    for tag, ckpt in jobs:
        name = tag.split("@")[0]
        hf_dir = work / "hf" / name
        arch = _arch(hf_dir)
        chunks = build_model_chunks(arch, BuildOptions(), trainable=False)
        load_checkpoint(ckpt, chunks, arch)
        out["tp1_mismatched"][tag] = _params_equal_to_hf(chunks, arch, hf_dir, BuildOptions())
        dest = work / "back" / tag
        megatron_to_hf(ckpt, dest, max_shard_size="150KB" if name == "qwen2" else "5GB")
        out["roundtrip"][tag] = compare_hf_folders(hf_dir, dest)
    megatron_to_hf(work / "tp1" / "llama_tied_dup", work / "back" / "llama_tied_dup")
    out["roundtrip"]["llama_tied_dup"] = compare_hf_folders(
        work / "hf" / "llama_tied_dup", work / "back" / "llama_tied_dup"
    )
    # A sharded HF input (the 150 KB-shard export, read through model.safetensors.index.json).
    hf_to_megatron(work / "back" / "qwen2", work / "from_sharded" / "qwen2")
    arch = _arch(work / "hf" / "qwen2")
    chunks = build_model_chunks(arch, BuildOptions(), trainable=False)
    load_checkpoint(work / "from_sharded" / "qwen2", chunks, arch)
    out["tp1_mismatched"]["qwen2@from_sharded_hf"] = _params_equal_to_hf(
        chunks, arch, work / "hf" / "qwen2", BuildOptions()
    )
    # fp32 source converted to bf16: every stored value is bf16 (also Megatron's fp32 norms).
    hf_to_megatron(work / "hf" / "qwen3", work / "bf16" / "qwen3", dtype="bf16")
    megatron_to_hf(work / "bf16" / "qwen3", work / "back" / "qwen3_from_bf16_ckpt")
    out["bf16_ckpt"] = compare_hf_folders(
        work / "hf" / "qwen3", work / "back" / "qwen3_from_bf16_ckpt", cast=torch.bfloat16
    )
    megatron_to_hf(work / "tp2pp2" / "qwen3", work / "back" / "qwen3_bf16", dtype="bf16")
    out["bf16"] = compare_hf_folders(work / "hf" / "qwen3", work / "back" / "qwen3_bf16", cast=torch.bfloat16)
    cfg = json.loads((work / "back" / "qwen3_bf16" / "config.json").read_text())
    out["bf16_config_dtype"] = cfg.get("dtype", cfg.get("torch_dtype"))
    return out


def compare_hf_folders(src: Path, dest: Path, cast: torch.dtype | None = None) -> dict:
    """Keys, dtypes and exact values of two HF folders' tensors; side files byte-identical."""
    from megatron_agent.weights.hf_io import HFCheckpointReader

    with HFCheckpointReader(src) as a, HFCheckpointReader(dest) as b:
        names_a, names_b = set(a.names()), set(b.names())
        differing = []
        for n in sorted(names_a & names_b):
            x, y = a.get(n), b.get(n)
            if cast is not None:
                x = x.to(cast)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                differing.append(n)
    side = sorted(
        p.name for p in src.iterdir() if not p.name.endswith(".safetensors") and "index" not in p.name
    )
    side_differ = [
        n for n in side if not (dest / n).is_file() or (dest / n).read_bytes() != (src / n).read_bytes()
    ]
    return {
        "only_in_source": sorted(names_a - names_b),
        "only_in_export": sorted(names_b - names_a),
        "differing": differing,
        "side_files_differ": side_differ,
        "files": sorted(p.name for p in dest.iterdir()),
    }


def main() -> None:
    stage, work = sys.argv[1], Path(sys.argv[2])
    result = {"convert": stage_convert, "reshard": stage_reshard, "export": stage_export}[stage](work)
    if dist.get_rank() == 0:
        (work / f"{stage}.json").write_text(json.dumps(result, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
