"""HF-named tensors in a format's layout: what a quantized engine loads and an export stores
(real quantized weights and their scales), or the same values dequantized (`*_qdq` rollout).

vLLM fuses q/k/v into one layer and gate/up into another, and an NVFP4 layer computes with one
second-level scale: the largest `weight_scale_2` of its pieces. So NVFP4 quantizes the pieces of
a fused layer with their common amax (`global_amax`), as ModelOpt's own export does; block
scales stay per piece. Quantized each on its own, k, v and gate/up would be served scaled by the
wrong factor (measured through vLLM's loader: up to 0.021 on weights of std 0.05). FP8 keeps one
scale per HF tensor (vLLM requantizes a fused layer's pieces to their largest scale itself).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from megatron_agent.quant.formats import QuantFormat, is_quantized_linear
from megatron_agent.quant.ops import fake_quantize, quantize

_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.[qkv]|mlp\.(?:gate|up))_proj\.weight$")


def fused_group(hf_name: str) -> list[str]:
    """The HF tensors vLLM fuses with `hf_name` into one layer (q/k/v, gate/up); [hf_name] otherwise."""
    m = _FUSED.match(hf_name)
    if m is None:
        return [hf_name]
    prefix, block = m.group(1), m.group(2).split(".")[0]
    members = ("q", "k", "v") if block == "self_attn" else ("gate", "up")
    return [f"{prefix}{block}.{x}_proj.weight" for x in members]


def global_amax(fmt: QuantFormat, hf_name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
    """The amax `hf_name` is quantized with: for NVFP4 the largest |w| over its fused group (`get`
    reads a tensor by name), fp32 []; None (the tensor's own) otherwise."""
    group = fused_group(hf_name)
    if fmt.kind != "nvfp4" or len(group) == 1:
        return None
    return torch.stack([get(name).detach().abs().amax().float() for name in group]).amax()


class GroupAmax:
    """`global_amax` by name, each fused group's computed once (`get` reads a tensor by name)."""

    def __init__(self, fmt: QuantFormat, get: Callable[[str], torch.Tensor]):
        self.fmt, self.get, self.cache = fmt, get, {}

    def __call__(self, hf_name: str) -> torch.Tensor | None:
        if not is_quantized_linear(hf_name):
            return None
        key = tuple(fused_group(hf_name))
        if key not in self.cache:
            self.cache[key] = global_amax(self.fmt, hf_name, self.get)
        return self.cache[key]


def scale_names(fmt: QuantFormat, hf_name: str) -> list[str]:
    """The scale tensors' names that go with the linear weight `hf_name` in `fmt`'s layout."""
    base = hf_name.removesuffix("weight")
    return [base + suffix for suffix in fmt.scale_suffixes]


def layout_tensors(
    fmt: QuantFormat, hf_name: str, tensor: torch.Tensor, amax: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] unchanged for a tensor the format leaves alone; for a decoder linear weight
    [(name, quantized data), (scale name, scale), ...] (ModelOpt's quantization, formats.py),
    with `amax` (`global_amax`) for the per-tensor scale when given."""
    if not is_quantized_linear(hf_name):
        return [(hf_name, tensor)]
    qw = quantize(fmt, tensor, global_amax=amax)
    return [(hf_name, qw.data)] + [
        (name, qw.scales[suffix]) for name, suffix in zip(scale_names(fmt, hf_name), fmt.scale_suffixes)
    ]


def qdq_tensors(
    fmt: QuantFormat, hf_name: str, tensor: torch.Tensor, amax: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] with a decoder linear weight quantized and dequantized (its dtype kept)."""
    if not is_quantized_linear(hf_name):
        return [(hf_name, tensor)]
    return [(hf_name, fake_quantize(fmt, tensor, global_amax=amax))]


def unit_tensors(
    fmt: QuantFormat, unit: list[tuple[str, torch.Tensor]], *, qdq: bool
) -> list[tuple[str, torch.Tensor]]:
    """A sync load unit (a fused group travels as one unit) in the format's layout, or dequantized."""
    amax = GroupAmax(fmt, dict(unit).__getitem__)
    convert = qdq_tensors if qdq else layout_tensors
    return [pair for name, tensor in unit for pair in convert(fmt, name, tensor, amax(name))]
