"""The weight formats of quantized rollout, QAT and export, each the weight quantizer of a ModelOpt
preset, and which HF tensors they quantize.

| format | ModelOpt preset (its weight quantizer) | one scale per | tensors in the layout |
|---|---|---|---|
| `fp8` | `FP8_DEFAULT_CFG` (e4m3, per tensor) | tensor | `weight` e4m3, `weight_scale` fp32 [] |
| `fp8_block128` | `FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG` | 128 x 128 tile | `weight` e4m3, `weight_scale_inv` fp32 [N/128, K/128] |
| `nvfp4` | `W4A16_NVFP4_CFG` (e2m1, 16-wide blocks, e4m3 block scales) | 16 inputs of a row | `weight` uint8 [N, K/2] (two e2m1 per byte), `weight_scale` e4m3 [N, K/16], `weight_scale_2` fp32 [] |

Only the decoder's linear weights are quantized (q/k/v/o, gate/up/down), each HF tensor on its
own (the unit ModelOpt quantizes in an HF model): embeddings, norms, biases and the output layer
stay in the model's dtype, as the presets leave `lm_head` and everything but linear layers alone.
Activations stay unquantized (weight-only: W8A16 and W4A16), so no format needs calibration data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

QUANTIZED_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)
"""The HF tensors the formats quantize (a Llama/Qwen decoder's linear weights)."""


def is_quantized_linear(hf_name: str) -> bool:
    """Whether the HF tensor `hf_name` is a decoder linear weight (quantized by every format)."""
    return QUANTIZED_LINEAR.match(hf_name) is not None


@dataclass(frozen=True)
class QuantFormat:
    """One weight format."""

    name: str
    kind: Literal["fp8", "nvfp4"]
    block: tuple[int, int] | None
    """(rows, columns) sharing one scale; None: one scale for the whole tensor."""
    modelopt_preset: str
    """The ModelOpt preset whose weight quantizer this format is."""
    scale_suffixes: tuple[str, ...]
    """Names of the scale tensors next to `<linear>.weight` (`<linear>.<suffix>`)."""

    def bytes_per_weight(self) -> float:
        """Bytes per quantized weight element, scales included (an N x K weight, large N and K)."""
        if self.kind == "nvfp4":
            return 0.5 + 1 / 16  # two e2m1 per byte, one e4m3 scale per 16
        return 1.0 + (4 / (self.block[0] * self.block[1]) if self.block else 0.0)


FORMATS = {
    "fp8": QuantFormat("fp8", "fp8", None, "FP8_DEFAULT_CFG", ("weight_scale",)),
    "fp8_block128": QuantFormat(
        "fp8_block128", "fp8", (128, 128), "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", ("weight_scale_inv",)
    ),
    "nvfp4": QuantFormat("nvfp4", "nvfp4", (1, 16), "W4A16_NVFP4_CFG", ("weight_scale", "weight_scale_2")),
}


def format_named(name: str) -> QuantFormat:
    """The format called `name` (ValueError naming the choices otherwise)."""
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}: choose one of {sorted(FORMATS)}")
    return FORMATS[name]


def fp8_format(fp8_scales: str) -> QuantFormat:
    """The FP8 format of `rollout.fp8_scales` ('tensor' or 'block128')."""
    return FORMATS["fp8" if fp8_scales == "tensor" else "fp8_block128"]


def rollout_format(quantization: str, fp8_scales: str = "tensor") -> tuple[QuantFormat | None, bool]:
    """(format, quantize-dequantize) of `rollout.quantization`: real quantized weights for 'fp8'
    and 'nvfp4_w4a16' (GPU), the same values dequantized into the engine's dtype for 'fp8_qdq'
    and 'nvfp4_qdq' (anywhere); (None, False) for ''."""
    if not quantization:
        return None, False
    family, qdq = quantization.removesuffix("_qdq"), quantization.endswith("_qdq")
    if family == "fp8":
        return fp8_format(fp8_scales), qdq
    if family in ("nvfp4", "nvfp4_w4a16"):
        return FORMATS["nvfp4"], qdq
    raise ValueError(f"rollout.quantization={quantization!r} names no weight format")
