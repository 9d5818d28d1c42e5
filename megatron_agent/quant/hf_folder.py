"""HF model folders in a weight format's layout, as vLLM 0.32 loads them: the quantized export
(`tools/convert/megatron_to_hf.py --quantize`) and the folder a quantized rollout engine starts
from (`rollout/quantized.py`).

A folder is the source's config and tokenizer files, config.json with the format's
`quantization_config` and dtype bfloat16, and one `model.safetensors`: the decoder's linear
weights in the format's layout (`quant.layout`), every other tensor in bf16.

| format | `quantization_config` | vLLM `quantization=` | tensors next to `<linear>.weight` |
|---|---|---|---|
| `fp8` | `{quant_method: fp8, activation_scheme: dynamic}` | `fp8` | `weight_scale` fp32 [] |
| `fp8_block128` | the same and `weight_block_size: [128, 128]` | `fp8` | `weight_scale_inv` fp32 [N/128, K/128] |
| `nvfp4` | `{quant_method: modelopt, quant_algo: W4A16_NVFP4, group_size: 16, ignore: [lm_head], ...}` | `modelopt_fp4` | `weight_scale` e4m3 [N, K/16], `weight_scale_2` fp32 [] |

What vLLM's W4A16 NVFP4 linear method registers for a linear layer fused from the HF tensors of
widths N_1..N_p (`ModelOptLinearMethod` with `KNvfp4Static` and `_DropInputScale`, in
vllm/model_executor/layers/quantization/modelopt.py): `weight` uint8 [sum N_i, K/2],
`weight_scale` float8_e4m3fn [sum N_i, K/16], `weight_scale_2` fp32 [p] (one scalar per HF tensor)
and `input_scale` fp32 [p]. `input_scale` is not written: vLLM registers it only to drop it
(filled with NaN, deleted after loading, a warning if a checkpoint had one), as ModelOpt's own
W4A16 export writes none. vLLM requires K % 16 == 0 and that every quantized linear's
`weight_scale` be loaded (a NaN left means a missing tensor); `lm_head` must be in `ignore`
(otherwise vLLM quantizes the output layer too).

One deviation from quantizing each HF tensor on its own, for NVFP4 only: vLLM computes a fused
layer (q/k/v as `qkv_proj`, gate/up as `gate_up_proj`) with ONE second-level scale, the largest
of its `weight_scale_2` (`KNvfp4Static.process`), so pieces quantized with their own would be
served scaled by the wrong factor. Like ModelOpt's HF export (`preprocess_linear_fusion`), the
pieces of a fused layer are quantized with their common amax (`global_amax`): `weight_scale_2`
is the same for q, k and v (and for gate and up), the block scales are each piece's own. FP8
needs no such step: vLLM's fp8 method requantizes the pieces to their largest scale itself.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from megatron_agent.quant.formats import FORMATS, QuantFormat, is_quantized_linear

STAMP = "quantized_source.json"
"""The file that makes `write_quantized_folder` reuse a folder written from the same source."""

NVFP4_GROUP = 16
_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.[qkv]|mlp\.(?:gate|up))_proj\.weight$")


def quantization_config(fmt: QuantFormat) -> dict:
    """The `quantization_config` entry of config.json that makes vLLM load `fmt`'s layout.

    FP8: vLLM's `fp8` method (the layout of FP8 checkpoints on the HF hub). NVFP4: what ModelOpt's
    HF export writes for W4A16_NVFP4 (`convert_hf_quant_config_format`), plus the top-level
    `group_size` that vLLM's `ModelOptQuantConfigBase.from_config` reads from config.json.
    """
    if fmt.kind == "fp8":
        cfg = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if fmt.block is not None:
            cfg["weight_block_size"] = list(fmt.block)
        return cfg
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": fmt.block[1]}
    return {
        "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
        "group_size": fmt.block[1],
        "ignore": ["lm_head"],
        "quant_algo": "W4A16_NVFP4",
        "quant_method": "modelopt",
    }


def vllm_quantization_name(fmt: QuantFormat) -> str:
    """vLLM's `quantization=` for a folder in `fmt`'s layout (the name its config class registers)."""
    return "fp8" if fmt.kind == "fp8" else "modelopt_fp4"


def format_of_config(config: dict) -> QuantFormat | None:
    """The format whose `quantization_config` config.json's `config` holds; None when it has none.
    Raises ValueError for a quantization this module does not write."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    for fmt in FORMATS.values():
        if qc == quantization_config(fmt):
            return fmt
    raise ValueError(
        f"quantization_config {json.dumps(qc)} is none of the layouts megatron-agent writes "
        f"({', '.join(FORMATS)}: quant.hf_folder.quantization_config)"
    )


def folder_format(folder: str | Path) -> QuantFormat | None:
    """The format of the HF folder `folder` (None: not quantized)."""
    return format_of_config(json.loads((Path(folder) / "config.json").read_text()))


def fused_group(hf_name: str) -> list[str]:
    """The HF tensors vLLM fuses with `hf_name` into one layer (q/k/v, gate/up); [hf_name] otherwise."""
    m = _FUSED.match(hf_name)
    if m is None:
        return [hf_name]
    prefix, block = m.group(1), m.group(2).split(".")[0]
    members = ("q", "k", "v") if block == "self_attn" else ("gate", "up")
    return [f"{prefix}{block}.{x}_proj.weight" for x in members]


def global_amax(fmt: QuantFormat, hf_name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
    """The amax `hf_name` is quantized with in a folder: for NVFP4 the largest |w| over its fused
    group (`get` reads a tensor by name), fp32 []; None (the tensor's own) otherwise."""
    group = fused_group(hf_name)
    if fmt.kind != "nvfp4" or len(group) == 1:
        return None
    return torch.stack([get(name).detach().abs().amax().float() for name in group]).amax()


def quantized_tensors(
    fmt: QuantFormat, hf_name: str, tensor: torch.Tensor, amax: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] of one HF tensor in a folder: a decoder linear weight as its quantized data
    and scales (`quant.layout`'s names; `amax`: `global_amax`), anything else in bf16."""
    from megatron_agent.quant.layout import layout_tensors, scale_names
    from megatron_agent.quant.ops import quantize

    if not is_quantized_linear(hf_name):
        return [(hf_name, tensor.to(torch.bfloat16))]
    if fmt.kind == "nvfp4" and tensor.shape[-1] % fmt.block[1]:
        raise ValueError(
            f"{hf_name}: {tensor.shape[-1]} input features, not a multiple of {fmt.block[1]}: vLLM's "
            "NVFP4 layers need whole 16-wide blocks"
        )
    if amax is None:
        return layout_tensors(fmt, hf_name, tensor)
    qw = quantize(fmt, tensor, global_amax=amax)
    names = scale_names(fmt, hf_name)
    return [(hf_name, qw.data)] + [(n, qw.scales[s]) for n, s in zip(names, fmt.scale_suffixes)]


def iter_folder_tensors(src: str | Path, fmt: QuantFormat) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the folder made from the HF folder `src`, one source tensor at a time
    (NVFP4 reads a fused group's other members again for its amax: memory-mapped, cheap)."""
    from megatron_agent.weights.hf_io import HFCheckpointReader

    with HFCheckpointReader(src) as reader:
        for name in reader.names():
            amax = global_amax(fmt, name, reader.get) if is_quantized_linear(name) else None
            yield from quantized_tensors(fmt, name, reader.get(name), amax)


def _stamp(src: Path, fmt: QuantFormat) -> dict:
    """What a folder was written from: the source (its weight files' sizes and times) and format."""
    weights = sorted(p for p in src.iterdir() if p.name.endswith((".safetensors", ".index.json")))
    return {
        "source": str(src.resolve()),
        "format": fmt.name,
        "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in weights},
    }


def write_quantized_folder(src: str | Path, dst: str | Path, fmt: QuantFormat, *, overwrite: bool = False) -> Path:
    """Write the HF folder `src` in `fmt`'s layout into `dst` (vLLM loads it with
    `quantization=vllm_quantization_name(fmt)`); returns `dst`.

    Idempotent: a `dst` written from the same source files in the same format (its stamp file
    says so) is reused as it is; one written by this function from anything else is replaced.
    Any other existing `dst` is refused (FileExistsError) unless `overwrite`. The folder is
    written next to `dst` and renamed into place when complete. The quantized tensors are held
    in host memory until written (about 1 byte per linear weight for FP8, 0.56 for NVFP4).
    """
    from safetensors.torch import save_file

    from megatron_agent.checkpoint.layout import hf_side_files, publish, staging_dir

    src, dst = Path(src), Path(dst)
    stamp = _stamp(src, fmt)
    marker = dst / STAMP
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return dst
    if dst.exists() and not marker.is_file() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"{dst} exists and is not a quantized folder: remove it or pass overwrite=True")
    staging = staging_dir(dst)
    staging.mkdir(parents=True)
    try:
        for f in hf_side_files(src):
            shutil.copy2(f, staging / f.name)
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = quantization_config(fmt)
        for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
            config[key] = "bfloat16"
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {name: t.contiguous() for name, t in iter_folder_tensors(src, fmt)}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / STAMP).write_text(json.dumps(stamp))
        publish(staging, dst, overwrite=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst


def dequantized_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every weight of a folder written by `write_quantized_folder`, in fp32: the linear weights
    dequantized by ModelOpt (`quant.ops.dequantize`), the rest as stored; scales are consumed."""
    from megatron_agent.quant.layout import scale_names
    from megatron_agent.quant.ops import QuantizedWeight, dequantize
    from megatron_agent.weights.hf_io import HFCheckpointReader

    fmt = folder_format(folder)
    if fmt is None:
        raise ValueError(f"{folder}: config.json has no quantization_config: not a quantized folder")
    out = {}
    with HFCheckpointReader(folder) as reader:
        names = reader.names()
        scales = {s for n in names if is_quantized_linear(n) for s in scale_names(fmt, n)}
        for name in names:
            if name in scales:
                continue
            if not is_quantized_linear(name):
                out[name] = reader.get(name).float()
                continue
            data = reader.get(name)
            found = {suffix: reader.get(s) for s, suffix in zip(scale_names(fmt, name), fmt.scale_suffixes)}
            k = data.shape[-1] * 2 if fmt.kind == "nvfp4" else data.shape[-1]
            out[name] = dequantize(fmt, QuantizedWeight(data, found, (data.shape[0], k)))
    return out


def expected_state_dict(fmt: QuantFormat, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `dequantized_state_dict` must return for a folder written from the HF `tensors`: each
    linear weight fake-quantized by ModelOpt (`quant.ops.fake_quantize`, with `global_amax`), in
    fp32; every other tensor rounded to bf16, in fp32."""
    from megatron_agent.quant.ops import fake_quantize

    out = {}
    for name, t in tensors.items():
        if is_quantized_linear(name):
            out[name] = fake_quantize(fmt, t.float(), global_amax(fmt, name, tensors.__getitem__))
        else:
            out[name] = t.to(torch.bfloat16).float()
    return out


def compare_folder(folder: str | Path, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The differences between a quantized folder and the HF `tensors` it should hold (empty:
    identical bit for bit): missing or extra tensors, and each differing tensor with its largest
    difference."""
    fmt = folder_format(folder)
    got, want = dequantized_state_dict(folder), expected_state_dict(fmt, tensors)
    problems = [f"{n}: missing from {folder}" for n in sorted(want.keys() - got.keys())]
    problems += [f"{n}: in {folder} but not in the checkpoint" for n in sorted(got.keys() - want.keys())]
    for name in sorted(want.keys() & got.keys()):
        a, b = got[name], want[name]
        if a.shape != b.shape:
            problems.append(f"{name}: shape {tuple(a.shape)} in the folder, {tuple(b.shape)} expected")
        elif not torch.equal(a, b):
            what = "dequantized != fake-quantized" if is_quantized_linear(name) else "!= bf16 of the checkpoint's"
            problems.append(f"{name}: {what} (max |diff| {(a - b).abs().max().item():.3e})")
    return problems
