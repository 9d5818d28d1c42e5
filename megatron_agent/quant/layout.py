"""HF-named tensors in a format's layout: what a quantized engine loads and an export stores
(real quantized weights and their scales), or the same values dequantized (`*_qdq` rollout)."""

from __future__ import annotations

import torch

from megatron_agent.quant.formats import QuantFormat, is_quantized_linear
from megatron_agent.quant.ops import fake_quantize, quantize


def scale_names(fmt: QuantFormat, hf_name: str) -> list[str]:
    """The scale tensors' names that go with the linear weight `hf_name` in `fmt`'s layout."""
    base = hf_name.removesuffix("weight")
    return [base + suffix for suffix in fmt.scale_suffixes]


def layout_tensors(fmt: QuantFormat, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] unchanged for a tensor the format leaves alone; for a decoder linear weight
    [(name, quantized data), (scale name, scale), ...] (ModelOpt's quantization, formats.py)."""
    if not is_quantized_linear(hf_name):
        return [(hf_name, tensor)]
    qw = quantize(fmt, tensor)
    return [(hf_name, qw.data)] + [
        (name, qw.scales[suffix]) for name, suffix in zip(scale_names(fmt, hf_name), fmt.scale_suffixes)
    ]


def qdq_tensors(fmt: QuantFormat, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] with a decoder linear weight quantized and dequantized (its dtype kept)."""
    if not is_quantized_linear(hf_name):
        return [(hf_name, tensor)]
    return [(hf_name, fake_quantize(fmt, tensor))]
