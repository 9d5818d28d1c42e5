"""Quantized HF folders (megatron_agent/quant/hf_folder.py) against vLLM's loader and ModelOpt.

- vLLM 0.32's own loader, on CPU, in a fresh process: the folder's config.json selects the vLLM
  config class `vllm_quantization_name` names (`EngineArgs(quantization=...)` checks it); the
  model is built with that quantization and `load_weights` reads every tensor of the folder into
  the parameters the quantized linear methods registered (their names, dtypes and shapes, fused
  into qkv_proj / gate_up_proj); every such parameter is loaded but NVFP4's `input_scale`, which
  vLLM drops. The weights vLLM then holds, dequantized as its kernels read them (vLLM's own NVFP4
  reference `dequantize_to_dtype` with the fused layer's one global scale; FP8: data times the
  scale of its piece or tile), equal our dequantized folder bit for bit. The only stand-in: the
  NVFP4 W4A16 GEMM kernel (Marlin and the like, CUDA only), which vLLM picks after registering the
  weights and which loading never calls.
- The dequantized folder equals ModelOpt's fake quantization of the source weights, bit for bit.
- The folder is reused when written from the same source in the same format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_agent.quant.formats import FORMATS, is_quantized_linear
from megatron_agent.quant.hf_folder import (
    STAMP,
    compare_folder,
    dequantized_state_dict,
    quantization_config,
    vllm_quantization_name,
    write_quantized_folder,
)
from megatron_agent.quant.layout import fused_group
from megatron_agent.quant.ops import fake_quantize
from megatron_agent.weights.hf_io import HFCheckpointReader

REPO = Path(__file__).resolve().parents[2]
# vLLM fuses these HF tensors into one layer, in this order.
FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with HFCheckpointReader(folder) as r:
        return {n: r.get(n) for n in r.names()}


@pytest.fixture(scope="module")
def folders(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """The tiny models in each format: '<model>/<format>'. fp8_block128 only for qwen3, whose k and
    v have 128 rows (the others have 64: refused, test below)."""
    root = tmp_path_factory.mktemp("quantized_folders")
    out = {}
    for model in ("llama_tied", "qwen2", "qwen3"):
        for name, fmt in FORMATS.items():
            if name != "fp8_block128" or model == "qwen3":
                out[f"{model}/{name}"] = write_quantized_folder(tiny_models[model], root / model / name, fmt)
    return out


def test_quantization_config_is_modelopts_export_for_nvfp4_and_vllms_fp8_layout():
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    assert quantization_config(FORMATS["fp8"]) == {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert quantization_config(FORMATS["fp8_block128"])["weight_block_size"] == [128, 128]
    modelopt = convert_hf_quant_config_format(
        {"quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    )
    assert quantization_config(FORMATS["nvfp4"]) == {**modelopt, "group_size": 16}


@pytest.mark.parametrize(
    "model, fmt_name",
    [
        (m, f)
        for m in ("llama_tied", "qwen2", "qwen3")
        for f in FORMATS
        if f != "fp8_block128" or m == "qwen3"
    ],
)
def test_dequantized_folder_is_modelopts_fake_quantization_of_the_source(
    folders, tiny_models, model, fmt_name
):
    fmt, folder, source = FORMATS[fmt_name], folders[f"{model}/{fmt_name}"], _tensors(tiny_models[model])
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == quantization_config(fmt) and config["dtype"] == "bfloat16"
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (folder / side).read_bytes() == (tiny_models[model] / side).read_bytes()
    stored = _tensors(folder)
    linear = [n for n in source if is_quantized_linear(n)]
    assert len(linear) == 7 * 4 and ("lm_head.weight" in source) == (model != "llama_tied")
    scales = {f"{n.removesuffix('weight')}{s}": n for n in linear for s in fmt.scale_suffixes}
    assert set(stored) == set(source) | set(scales)
    want_dtype = {"fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}[fmt.kind]
    assert all(stored[n].dtype == want_dtype for n in linear)
    assert all(stored[n].dtype == torch.bfloat16 for n in source if n not in linear)

    got = dequantized_state_dict(folder)
    assert set(got) == set(source)
    for name, w in source.items():
        if not is_quantized_linear(name):
            assert torch.equal(got[name], w.to(torch.bfloat16).float()), name
            continue
        group = fused_group(name)
        if fmt.kind == "nvfp4" and len(group) > 1:
            # One second-level scale per fused layer, from the group's amax (what vLLM computes with).
            amax = torch.stack([source[n].abs().amax() for n in group]).amax()
            assert torch.equal(got[name], fake_quantize(fmt, w, global_amax=amax)), name
            assert len({stored[f"{n.removesuffix('weight')}weight_scale_2"].item() for n in group}) == 1
        else:
            assert torch.equal(got[name], fake_quantize(fmt, w)), name
        assert not torch.equal(got[name], w), name  # it did quantize


def test_compare_folder_names_each_differing_tensor(folders, tiny_models, tmp_path):
    from safetensors.torch import save_file

    source = _tensors(tiny_models["qwen2"])
    assert compare_folder(folders["qwen2/fp8"], source) == []
    folder = tmp_path / "q"
    folder.mkdir()
    for f in folders["qwen2/fp8"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    stored = _tensors(folder)
    bits = stored["model.layers.2.mlp.up_proj.weight"].view(torch.uint8)
    bits[0, 0] ^= 0x11  # one byte of the quantized data
    stored["model.norm.weight"] = stored["model.norm.weight"] * 2
    save_file(stored, str(folder / "model.safetensors"))
    del source["model.layers.0.input_layernorm.weight"]
    problems = compare_folder(folder, source)
    assert len(problems) == 3, problems
    assert problems[0].startswith("model.layers.2.mlp.up_proj.weight: dequantized != fake-quantized")
    assert problems[1].startswith("model.norm.weight: != the bf16 of")
    assert problems[2] == f"model.layers.0.input_layernorm.weight: in {folder} but not in the checkpoint"


def test_fp8_block128_refuses_k_and_v_sharing_a_tile(tiny_models, tmp_path):
    with pytest.raises(ValueError, match=r"k_proj.weight: 64 rows, not a multiple of 128.*v_proj"):
        write_quantized_folder(tiny_models["qwen2"], tmp_path / "q", FORMATS["fp8_block128"])
    assert not (tmp_path / "q").exists() and not list(tmp_path.iterdir())  # nothing left behind


def test_folder_is_reused_for_the_same_source_and_format_and_rewritten_otherwise(tiny_models, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for f in tiny_models["qwen2"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    write_quantized_folder(src, dst, FORMATS["fp8"])
    first = (dst / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert write_quantized_folder(src, dst, FORMATS["fp8"]) == dst
    assert time.perf_counter() - start < 0.5 and (dst / "model.safetensors").stat().st_mtime_ns == first
    write_quantized_folder(src, dst, FORMATS["nvfp4"])  # another format: rewritten
    assert json.loads((dst / STAMP).read_text())["format"] == "nvfp4"
    assert _tensors(dst)["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8
    before = (dst / "model.safetensors").stat().st_mtime_ns
    os.utime(src / "model.safetensors")  # the source changed: rewritten
    write_quantized_folder(src, dst, FORMATS["nvfp4"])
    assert (dst / "model.safetensors").stat().st_mtime_ns != before
    with pytest.raises(FileExistsError, match="not a quantized folder"):
        write_quantized_folder(dst, src, FORMATS["fp8"])  # never replaces a folder it did not write


def test_vllm_loads_each_layout_into_the_weights_its_kernels_read(folders, tmp_path):
    out = tmp_path / "vllm"
    names = [f"qwen3/{f}" for f in FORMATS]
    cmd = [
        sys.executable,
        __file__,
        str(out),
        *(f"{folders[n]}={vllm_quantization_name(FORMATS[n[6:]])}" for n in names),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads((out / "report.json").read_text())
    vllm_weights = _tensors(out)
    for name in names:
        fmt, folder, r = FORMATS[name[6:]], folders[name], report[str(folders[name])]
        assert r["quantization"] == vllm_quantization_name(fmt), r
        assert r["quant_config"] == {"fp8": "Fp8Config", "nvfp4": "ModelOptNvFp4Config"}[fmt.kind]
        # Every parameter of the quantized layers came from the folder, but NVFP4's input_scale.
        dropped = {"input_scale"} if fmt.kind == "nvfp4" else set()
        assert {p.rsplit(".", 1)[1] for p in r["not_loaded"] if ".attn." not in p} == dropped, r["not_loaded"]
        stored, ours = _tensors(folder), dequantized_state_dict(folder)
        for param, (dtype, shape) in r["params"].items():
            layer, attr = param.rsplit(".", 1)
            prefix, fused = layer.split(".self_attn.") if ".self_attn." in layer else layer.split(".mlp.")
            block = "self_attn" if ".self_attn." in layer else "mlp"
            pieces = [f"{prefix}.{block}.{x}_proj" for x in FUSED.get(f"{block}.{fused}", (fused[:-5],))]
            if attr == "input_scale":
                continue
            parts = [stored[f"{p}.{attr}"] for p in pieces]
            want = (
                (len(parts),)
                if parts[0].dim() == 0
                else (sum(t.shape[0] for t in parts), *parts[0].shape[1:])
            )
            assert (dtype, tuple(shape)) == (str(parts[0].dtype), want), param
        for layer, served in (
            (k.removesuffix(".weight"), v) for k, v in vllm_weights.items() if k.startswith(f"{name}/")
        ):
            layer = layer[len(name) + 1 :]
            prefix, block, fused = layer.rsplit(".", 2)
            pieces = FUSED.get(f"{block}.{fused}", (fused[:-5],))
            ref = torch.cat([ours[f"{prefix}.{block}.{x}_proj.weight"] for x in pieces])
            assert torch.equal(served, ref), f"{name}: {layer}"
        assert sum(k.startswith(f"{name}/") for k in vllm_weights) == 4 * 4


# ------------------------------------------------------------------------------ vLLM, in a process
def _vllm_load(out: Path, folders: dict[str, str]) -> None:
    """Build each folder's model with vLLM's quantization, load the folder with vLLM's loader and
    write what it registered and loaded, and its linear weights dequantized as vLLM reads them."""
    import socket
    import types
    from unittest import mock

    from safetensors.torch import save_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import fp8 as vllm_fp8
    from vllm.model_executor.layers.quantization import modelopt as vllm_modelopt
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.utils.torch_utils import set_default_torch_dtype

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
    # vLLM's W4A16 NVFP4 GEMM kernels exist on CUDA only, and its CPU kernels for FP8 in 128 x 128
    # tiles need AMX (Sapphire Rapids or newer: not an AMD EPYC); it picks one after registering
    # the layer's weights, and loading does not use it.
    no_kernel = types.SimpleNamespace(input_quant_key=lambda: None)
    report, served = {}, {}
    for folder, quantization in folders.items():
        args = EngineArgs(model=folder, quantization=quantization, dtype="bfloat16", enforce_eager=True)
        config = args.create_engine_config()
        with (
            set_current_vllm_config(config),
            set_default_torch_dtype(config.model_config.dtype),
            mock.patch.object(vllm_modelopt, "select_linear_kernel", lambda *a, **k: no_kernel),
            mock.patch.object(vllm_fp8, "init_fp8_linear_kernel", lambda *a, **k: no_kernel),
        ):
            model = initialize_model(vllm_config=config)
            files = [str(Path(folder) / "model.safetensors")]
            loaded = model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        tag = Path(folder).parent.name + "/" + Path(folder).name
        report[folder] = {
            "quantization": config.model_config.quantization,
            "quant_config": type(config.quant_config).__name__,
            "not_loaded": sorted(set(params) - set(loaded)),
            "params": {
                n: [str(p.dtype), list(p.shape)]
                for n, p in params.items()
                if n.endswith(
                    ("proj.weight", "weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale")
                )
            },
        }
        for name, module in modules.items():
            if not name.endswith(("qkv_proj", "gate_up_proj", "o_proj", "down_proj")):
                continue
            w = module.weight.data
            if quantization == "modelopt_fp4":
                # vLLM's NVFP4 reference: one global scale per layer, the largest weight_scale_2.
                global_scale = module.weight_scale_2.data.max()
                deq = dequantize_to_dtype(
                    w, module.weight_scale.data, global_scale, torch.float32, 16, swizzle=False
                )
            elif hasattr(module, "weight_scale_inv"):  # 128 x 128 tiles
                tiles = module.weight_scale_inv.data.repeat_interleave(128, 0).repeat_interleave(128, 1)
                deq = w.float() * tiles[: w.shape[0], : w.shape[1]]
            else:  # one scale per piece (vLLM requantizes them to the largest after loading)
                widths = module.logical_widths
                deq = torch.cat([p.float() * s for p, s in zip(w.split(widths), module.weight_scale.data)])
            served[f"{tag}/{name}.weight"] = deq.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(served, str(out / "model.safetensors"))
    (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _vllm_load(Path(sys.argv[1]), dict(arg.rsplit("=", 1) for arg in sys.argv[2:]))
