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
is written per HF tensor, as hub checkpoints are: vLLM's fp8 method requantizes the pieces of a
fused layer to their largest scale after loading (`requantize_with_max_scale`: one more e4m3
rounding for the pieces with a smaller scale).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from megatron_agent.quant.formats import FORMATS, QuantFormat, is_quantized_linear
from megatron_agent.quant.layout import GroupAmax, fused_group, global_amax

STAMP = "quantized_source.json"
"""The file that makes `write_quantized_folder` reuse a folder written from the same source."""


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


def quantized_tensors(
    fmt: QuantFormat, hf_name: str, tensor: torch.Tensor, amax: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] of one HF tensor in a folder: a decoder linear weight as its quantized data
    and scales (`quant.layout`'s names; `amax`: `global_amax`), anything else in bf16."""
    from megatron_agent.quant.layout import layout_tensors

    if not is_quantized_linear(hf_name):
        return [(hf_name, tensor.to(torch.bfloat16))]
    check_vllm_shape(fmt, hf_name, tuple(tensor.shape))
    return layout_tensors(fmt, hf_name, tensor, amax)


def check_vllm_shape(fmt: QuantFormat, hf_name: str, shape: tuple[int, ...]) -> None:
    """Raise ValueError naming the tensor when vLLM cannot load the linear weight `hf_name` of
    `shape` in `fmt`'s layout: NVFP4 needs whole 16-wide blocks along a row; 128 x 128 FP8 needs
    every piece of a fused layer but the last (q, k of q/k/v; gate of gate/up) to fill whole tile
    rows, since vLLM stores one scale grid for the fused layer (`validate_fp8_block_shape`)."""
    if fmt.kind == "nvfp4" and shape[-1] % fmt.block[1]:
        raise ValueError(
            f"{hf_name}: {shape[-1]} input features, not a multiple of {fmt.block[1]}: vLLM's NVFP4 "
            "layers need whole 16-wide blocks"
        )
    group = fused_group(hf_name)
    if fmt.kind == "fp8" and fmt.block and hf_name in group[:-1] and shape[0] % fmt.block[0]:
        raise ValueError(
            f"{hf_name}: {shape[0]} rows, not a multiple of {fmt.block[0]}: vLLM fuses it with "
            f"{group[group.index(hf_name) + 1]} into one layer whose {fmt.block[0]}x{fmt.block[1]} "
            "scale tiles would straddle the two; use the per-tensor format (fp8) for this model"
        )


def linear_shapes(arch) -> dict[str, tuple[int, int]]:
    """The [out, in] shapes of one decoder layer's linear weights (layer 0's HF names) of the
    `models.hf_config.ModelArch` `arch`."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    h, f = arch.hidden_size, arch.ffn_hidden_size
    shapes = {
        "q": (q, h),
        "k": (kv, h),
        "v": (kv, h),
        "o": (h, q),
        "gate": (f, h),
        "up": (f, h),
        "down": (h, f),
    }
    block = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn"}
    return {f"model.layers.0.{block.get(x, 'mlp')}.{x}_proj.weight": s for x, s in shapes.items()}


def check_vllm_shapes(fmt: QuantFormat, arch) -> None:
    """`check_vllm_shape` for every linear weight of a model of architecture `arch`, before any work."""
    for name, shape in linear_shapes(arch).items():
        check_vllm_shape(fmt, name, shape)


def iter_folder_tensors(src: str | Path, fmt: QuantFormat) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the folder made from the HF folder `src`, one source tensor at a time
    (NVFP4 reads a fused group's members once more for their common amax: memory-mapped).
    Raises ValueError before quantizing anything when vLLM could not load a weight's layout."""
    from megatron_agent.weights.hf_io import HFCheckpointReader

    with HFCheckpointReader(src) as reader:
        for name in reader.names():
            if is_quantized_linear(name):
                check_vllm_shape(fmt, name, tuple(reader.get_slice(name).get_shape()))
        amax = GroupAmax(fmt, reader.get)
        for name in reader.names():
            yield from quantized_tensors(fmt, name, reader.get(name), amax(name))


def _stamp(src: Path, fmt: QuantFormat) -> dict:
    """What a folder was written from: the source (its weight files' sizes and times) and format."""
    weights = sorted(p for p in src.iterdir() if p.name.endswith((".safetensors", ".index.json")))
    return {
        "source": str(src.resolve()),
        "format": fmt.name,
        "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in weights},
    }


def write_quantized_folder(
    src: str | Path, dst: str | Path, fmt: QuantFormat, *, overwrite: bool = False
) -> Path:
    """Write the HF folder `src` in `fmt`'s layout into `dst` (vLLM loads it with
    `quantization=vllm_quantization_name(fmt)`); returns `dst`.

    Idempotent: a `dst` written from the same source files in the same format (its stamp file
    says so) is reused as it is; one written by this function from anything else is replaced.
    Any other existing `dst` is refused (FileExistsError) unless `overwrite`. The folder is
    written next to `dst` and renamed into place when complete. The quantized tensors are held
    in host memory until written (1 byte per linear weight for FP8, 0.56 for NVFP4, the rest bf16).
    """
    from safetensors.torch import save_file

    from megatron_agent.weights.folders import hf_side_files, publish, staging_dir

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
        shutil.copymode(staging / "config.json", staging / "model.safetensors")  # safetensors writes 0600
        (staging / STAMP).write_text(json.dumps(stamp))
        publish(staging, dst, overwrite=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst


def _weight_names(fmt: QuantFormat, names: list[str]) -> list[str]:
    """The weights among a folder's tensor `names` (its scale tensors left out)."""
    from megatron_agent.quant.layout import scale_names

    scales = {s for n in names if is_quantized_linear(n) for s in scale_names(fmt, n)}
    return [n for n in names if n not in scales]


def _dequantized(reader, fmt: QuantFormat, name: str) -> torch.Tensor:
    """One weight of an open folder in fp32: a linear weight dequantized by ModelOpt, the rest as stored."""
    from megatron_agent.quant.layout import scale_names
    from megatron_agent.quant.ops import QuantizedWeight, dequantize

    data = reader.get(name)
    if not is_quantized_linear(name):
        return data.float()
    scales = {suffix: reader.get(s) for s, suffix in zip(scale_names(fmt, name), fmt.scale_suffixes)}
    k = data.shape[-1] * 2 if fmt.kind == "nvfp4" else data.shape[-1]  # two e2m1 values per byte
    return dequantize(fmt, QuantizedWeight(data, scales, (data.shape[0], k)))


def _quantized_folder(folder: str | Path) -> QuantFormat:
    fmt = folder_format(folder)
    if fmt is None:
        raise ValueError(f"{folder}: config.json has no quantization_config: not a quantized folder")
    return fmt


def weight_names(folder: str | Path) -> list[str]:
    """The weights of a quantized folder (its tensors but the scales)."""
    from megatron_agent.weights.hf_io import HFCheckpointReader

    fmt = _quantized_folder(folder)
    with HFCheckpointReader(folder) as reader:
        return _weight_names(fmt, reader.names())


def dequantized_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every weight of a folder written by `write_quantized_folder`, in fp32: the linear weights
    dequantized by ModelOpt (`quant.ops.dequantize`), the rest as stored; scales are consumed."""
    from megatron_agent.weights.hf_io import HFCheckpointReader

    fmt = _quantized_folder(folder)
    with HFCheckpointReader(folder) as reader:
        return {n: _dequantized(reader, fmt, n) for n in _weight_names(fmt, reader.names())}


def expected_tensor(fmt: QuantFormat, name: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """What `dequantized_state_dict` must hold under `name` for a folder written from the HF
    `tensors`: a linear weight fake-quantized by ModelOpt (`quant.ops.fake_quantize`, with
    `global_amax`), any other tensor rounded to bf16; in fp32."""
    from megatron_agent.quant.ops import fake_quantize

    t = tensors[name]
    if not is_quantized_linear(name):
        return t.to(torch.bfloat16).float()
    return fake_quantize(fmt, t.float(), global_amax(fmt, name, tensors.__getitem__))


def compare_folder(
    folder: str | Path, tensors: Mapping[str, torch.Tensor], *, complete: bool = True
) -> list[str]:
    """The differences between a quantized folder and the HF `tensors` it should hold, one line
    each (empty: identical bit for bit): tensors missing from the folder, each differing tensor
    with its largest difference, and (`complete`) weights of the folder absent from `tensors`.
    One tensor is dequantized at a time."""
    from megatron_agent.weights.hf_io import HFCheckpointReader

    fmt = _quantized_folder(folder)
    problems = []
    with HFCheckpointReader(folder) as reader:
        names = set(_weight_names(fmt, reader.names()))
        for name in sorted(tensors):
            if name not in names:
                problems.append(f"{name}: missing from {folder}")
                continue
            got, want = _dequantized(reader, fmt, name), expected_tensor(fmt, name, tensors)
            if got.shape != want.shape:
                problems.append(
                    f"{name}: shape {tuple(got.shape)} in the folder, {tuple(want.shape)} expected"
                )
            elif not torch.equal(got, want):
                what = "dequantized != fake-quantized" if is_quantized_linear(name) else "!= the bf16 of"
                problems.append(
                    f"{name}: {what} checkpoint's (max |diff| {(got - want).abs().max().item():.3e})"
                )
    if complete:
        problems += [f"{n}: in {folder} but not in the checkpoint" for n in sorted(names - set(tensors))]
    return problems
