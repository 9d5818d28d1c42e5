"""FP8 rollout: the BF16 actor's linear weights served by vLLM as FP8 (e4m3), quantized at sync time.

`rollout.quantization=fp8` makes vLLM load an FP8 checkpoint in the layout vLLM's `fp8` method
reads (the layout of FP8 checkpoints on the HF hub):

- per-tensor (`rollout.fp8_scales=tensor`): `<linear>.weight` in float8_e4m3fn and
  `<linear>.weight_scale`, one fp32 scalar, with `weight ~= weight_fp8 * weight_scale`;
- blockwise (`rollout.fp8_scales=block128`): `<linear>.weight` in float8_e4m3fn and
  `<linear>.weight_scale_inv`, fp32 [ceil(out/128), ceil(in/128)], one scale per 128x128 tile
  (DeepSeek-V3's name; it multiplies, like the per-tensor scale), and
  `quantization_config.weight_block_size = [128, 128]`.

Only the decoder's linear layers are quantized (q/k/v/o, gate/up/down): embeddings, norms,
biases and the output layer stay BF16, as in vLLM's fp8 checkpoints. Activations are quantized
by vLLM itself (`activation_scheme: dynamic`), so no calibration data is needed.

At engine start the HF folder is converted once (`prepare_fp8_engine`, `write_fp8_checkpoint`);
at every sync the sender quantizes each load unit the same way (`Fp8Quantizer.quantize_unit`,
picked by `sync.fp8`) and the engine's in-place reload consumes FP8 weights and their scales.
The policy gap this opens between the FP8 rollout and the BF16 trainer is what truncated
importance sampling corrects (`algorithm.rollout_is=auto` turns it on in this mode; the
`mismatch/*` metrics measure it).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128
SCALES = ("tensor", "block128")
QUANTIZATIONS = ("", "fp8")

# The linear layers vLLM's fp8 method quantizes in a Llama/Qwen decoder.
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def is_quantized_linear(hf_name: str) -> bool:
    """Whether an HF tensor is a decoder linear weight served in FP8."""
    return _LINEAR.match(hf_name) is not None


def scale_name(hf_name: str, scales: str) -> str:
    """The name of the scale tensor that goes with linear weight `hf_name`."""
    suffix = "weight_scale" if scales == "tensor" else "weight_scale_inv"
    return hf_name.removesuffix("weight") + suffix


def check_fp8_rollout_supported() -> None:
    """Raise ValueError naming what is missing where vLLM cannot serve FP8 weights here."""
    if not torch.cuda.is_available():
        raise ValueError(
            "rollout.quantization=fp8 needs a CUDA GPU: vLLM's FP8 kernels (FP8 tensor cores on "
            "compute capability >= 8.9, Marlin weight-only on 8.0-8.6) do not exist on CPU; "
            "set rollout.quantization='' on this machine"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 0):
        raise ValueError(
            f"rollout.quantization=fp8 needs a GPU of compute capability >= 8.0; "
            f"{torch.cuda.get_device_name()} is {major}.{minor}"
        )


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_fp8 [same shape], scale [] fp32) with w ~= weight_fp8.float() * scale.

    The scale maps the tensor's largest |w| to FP8's largest finite value (448); an all-zero
    tensor gets scale 1. Computed in fp32 whatever the input dtype.
    """
    w32 = w.detach().float()
    amax = w32.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(())


def quantize_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_fp8 [N, K], scale_inv [ceil(N/block), ceil(K/block)] fp32), one scale per tile.

    Edge tiles (N or K not a multiple of `block`) are scaled by their own elements only.
    """
    if w.dim() != 2:
        raise ValueError(f"blockwise FP8 quantizes 2-D weights; got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    w32 = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    w32[:n, :k] = w.detach().float()
    tiles = w32.view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * block, kb * block)
    return q[:n, :k].to(FP8_DTYPE).contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """fp32 weight from an FP8 weight and its per-tensor ([]) or blockwise ([nb, kb]) scale."""
    q32 = q.float()
    if scale.dim() == 0 or scale.numel() == 1:
        return q32 * scale.float().reshape(())
    n, k = q.shape
    full = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return q32 * full[:n, :k]


@dataclass(frozen=True)
class Fp8Quantizer:
    """Turns HF-named BF16 tensors into what an FP8 vLLM engine loads (same names, plus scales)."""

    scales: str = "tensor"
    """'tensor' (one scale per weight) or 'block128' (one per 128x128 tile)."""

    def __post_init__(self):
        if self.scales not in SCALES:
            raise ValueError(f"rollout.fp8_scales={self.scales!r}: choose one of {SCALES}")

    def quantize(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """[(name, tensor)] unchanged for non-linear tensors; [(name, fp8), (scale name, fp32)] otherwise."""
        if not is_quantized_linear(name):
            return [(name, tensor)]
        q, s = quantize_per_tensor(tensor) if self.scales == "tensor" else quantize_blockwise(tensor)
        return [(name, q), (scale_name(name, self.scales), s)]

    def quantize_unit(self, unit: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """A sync load unit with its linear weights quantized (the unit stays one unit)."""
        return [pair for name, tensor in unit for pair in self.quantize(name, tensor)]

    def quantization_config(self) -> dict:
        """The `quantization_config` of config.json that makes vLLM read this layout."""
        cfg = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if self.scales == "block128":
            cfg["weight_block_size"] = [BLOCK, BLOCK]
        return cfg


def iter_fp8_checkpoint(src: str | Path, quantizer: Fp8Quantizer) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the FP8 checkpoint made from the HF folder `src`, one tensor at a time."""
    from megatron_agent.weights.hf_io import HFCheckpointReader

    with HFCheckpointReader(src) as reader:
        for name in reader.names():
            yield from quantizer.quantize(name, reader.get(name).to(torch.bfloat16))


def write_fp8_checkpoint(src: str | Path, dst: str | Path, scales: str = "tensor") -> Path:
    """Write the FP8 copy of the HF folder `src` into `dst` (vLLM loads it with quantization='fp8').

    Config and tokenizer files are copied; config.json gets the `quantization_config`. Idempotent:
    an existing complete `dst` for the same source and scales is reused. The FP8 tensors are held
    in host memory until written (about 1 byte per linear parameter).
    """
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    quantizer = Fp8Quantizer(scales)
    stamp = {"source": str(src.resolve()), "scales": scales}
    marker = dst / "fp8_source.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantizer.quantization_config()
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: t.contiguous() for name, t in iter_fp8_checkpoint(src, quantizer)}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text(json.dumps(stamp))
    return dst


def prepare_fp8_engine(
    model_path: str | Path, quantization: str, scales: str, dtype: str, cache_dir: str | None
) -> tuple[Path, dict]:
    """Check that FP8 serving works here and write the FP8 folder; (folder, engine `quantization` info).

    Raises ValueError naming the setting or what is missing (no GPU, an fp32 rollout, a bad name).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"rollout.quantization={quantization!r}: choose one of {QUANTIZATIONS}")
    Fp8Quantizer(scales)  # validates the name
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(
            f"rollout.quantization=fp8 runs activations in bf16 or fp16; model.dtype gives {dtype}"
        )
    check_fp8_rollout_supported()
    import tempfile

    root = Path(cache_dir) if cache_dir else Path(tempfile.mkdtemp(prefix="megatron-agent-fp8-"))
    folder = write_fp8_checkpoint(model_path, root / f"fp8_{scales}_{Path(model_path).name}", scales)
    return folder, {"method": "fp8", "scales": scales}
