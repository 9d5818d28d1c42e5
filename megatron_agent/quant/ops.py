"""ModelOpt's quantization of one weight: quantize (the layout an engine or an export stores),
dequantize, and fake-quantize (quantize then dequantize), for the formats of `formats.py`.

The values come from ModelOpt's quantized-tensor classes (`FP8QTensor`, `NVFP4QTensor`), which
its own export uses and which run on CPU (its fake-quant modules need CUDA for NVFP4). Weights
are quantized from fp32 whatever their dtype: ModelOpt's FP8 fake quantizer and `FP8QTensor` then
agree bit for bit (from a bf16 tensor `FP8QTensor` derives a bf16 scale, and they do not).

`global_amax` quantizes a piece of a larger tensor (one tensor-parallel shard) exactly as the
whole tensor would be: the per-tensor scale (FP8) or the second-level scale (NVFP4) comes from
the whole tensor's amax; block scales are the piece's own, which is the whole tensor's when the
piece starts and ends on block boundaries (`qat.py` checks that).

Kept from the hand-written code this replaces, for a measured reason: an all-zero tensor or FP8
tile gets scale 1 (ModelOpt divides by a zero scale and returns NaN for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_agent.quant.formats import QuantFormat

FP8_MAX = 448.0
E2M1_MAX = 6.0


@dataclass
class QuantizedWeight:
    """One quantized weight: its data and its scales ({suffix: tensor}, formats.py's names)."""

    data: torch.Tensor
    scales: dict[str, torch.Tensor]
    shape: tuple[int, ...]


def _fp8_block_amax(w32: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    from modelopt.torch.quantization.utils import reduce_block_amax, reduce_block_padding

    sizes = {-2: block[0], -1: block[1]}
    return reduce_block_amax(reduce_block_padding(w32, sizes), sizes)


def quantize(fmt: QuantFormat, w: torch.Tensor, global_amax: torch.Tensor | None = None) -> QuantizedWeight:
    """`w` [N, K] in `fmt`'s layout (ModelOpt's quantized tensors)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    w32 = w.detach().float()
    amax = (w32.abs().amax() if global_amax is None else global_amax.float()).reshape(())
    if fmt.kind == "fp8":
        if fmt.block is None:
            scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            q, scale = FP8QTensor.quantize(w32, scales=scale)
        else:
            tiles = _fp8_block_amax(w32, fmt.block)
            scale = torch.where(tiles > 0, tiles / FP8_MAX, torch.ones_like(tiles))
            q, scale = FP8QTensor.quantize(
                w32, scales=scale, block_sizes={-2: fmt.block[0], -1: fmt.block[1]}
            )
        return QuantizedWeight(q._quantized_data, {fmt.scale_suffixes[0]: scale.float()}, tuple(w.shape))
    scale_2 = torch.where(amax > 0, amax / (E2M1_MAX * FP8_MAX), torch.ones_like(amax))
    q, block_scale, scale_2 = NVFP4QTensor.quantize(w32, fmt.block[1], weights_scaling_factor_2=scale_2)
    return QuantizedWeight(
        q._quantized_data, {"weight_scale": block_scale, "weight_scale_2": scale_2.float()}, tuple(w.shape)
    )


def dequantize(fmt: QuantFormat, qw: QuantizedWeight) -> torch.Tensor:
    """The fp32 weight a `QuantizedWeight` stands for (ModelOpt's dequantization)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    if fmt.kind == "fp8":
        q = FP8QTensor(qw.shape, torch.float32, qw.data)
        scale = qw.scales[fmt.scale_suffixes[0]]
        if fmt.block is None:
            return q.dequantize(dtype=torch.float32, scale=scale)
        return q.dequantize(
            dtype=torch.float32, scale=scale, block_sizes={-2: fmt.block[0], -1: fmt.block[1]}
        )
    q = NVFP4QTensor(qw.shape, torch.float32, qw.data)
    out = q.dequantize(
        dtype=torch.float32,
        scale=qw.scales["weight_scale"],
        double_scale=qw.scales["weight_scale_2"],
        block_sizes={-1: fmt.block[1]},
    )
    return out[..., : qw.shape[-1]]


def fake_quantize(fmt: QuantFormat, w: torch.Tensor, global_amax: torch.Tensor | None = None) -> torch.Tensor:
    """`w` quantized and dequantized by ModelOpt (fp32 values, returned in `w`'s dtype)."""
    return dequantize(fmt, quantize(fmt, w, global_amax)).to(w.dtype)


def layout_bytes(qw: QuantizedWeight) -> int:
    """Bytes of a quantized weight as stored or sent: data and scales."""
    return qw.data.numel() * qw.data.element_size() + sum(
        s.numel() * s.element_size() for s in qw.scales.values()
    )
