"""Quantized rollout weights on the sync side: the quantizer the engines ask for, and wire dtypes.

An engine started with `rollout.quantization` says which in its `info()` ({"quantization": ...,
"format": ...}); at every sync the sender passes each load unit through the `RolloutQuantizer`
that `rollout_quantizer` builds from the engines' answers: ModelOpt's quantization of the decoder
linear weights (`megatron_agent.quant`), either real (FP8 or NVFP4 data and scales, in the layout
the engine's quantization method loads: GPU engines) or quantized and dequantized into the
rollout dtype (`*_qdq`: any engine, the same policy gap). The buckets keep quantized data and
scales in their own dtypes (`wire_dtype`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from megatron_agent.quant.formats import QuantFormat, format_named

_OWN_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # quantized data and NVFP4 block scales
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".weight_scale_2")


def wire_dtype(name: str, tensor: torch.Tensor, rollout_dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels in: quantized weights and their scales keep theirs, the rest
    `rollout_dtype`."""
    if tensor.dtype in _OWN_DTYPES or name.endswith(_SCALE_SUFFIXES):
        return tensor.dtype
    return rollout_dtype


@dataclass(frozen=True)
class RolloutQuantizer:
    """Turns HF-named tensors into what a quantized engine loads."""

    quantization: str
    """The engines' `rollout.quantization`."""
    fmt: QuantFormat
    qdq: bool
    """Send the quantized values dequantized (in the rollout dtype) instead of data and scales."""

    def quantize_unit(self, unit: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """A sync load unit with its linear weights quantized (the unit stays one unit)."""
        from megatron_agent.quant.layout import unit_tensors

        return unit_tensors(self.fmt, unit, qdq=self.qdq)


def rollout_quantizer(engine_infos: list[dict]) -> RolloutQuantizer | None:
    """The quantizer the engines ask for in their `info()` (None: they serve the actor's dtype).

    Every engine of one sync must serve the same weight format: they all get the same buckets.
    """
    formats = {json.dumps(i.get("quantization"), sort_keys=True) for i in engine_infos}
    if len(formats) > 1:
        raise ValueError(
            f"rollout engines serve different weight formats {sorted(formats)}; start them alike"
        )
    q = engine_infos[0].get("quantization") if engine_infos else None
    if not q:
        return None
    if not isinstance(q, dict) or "format" not in q:
        raise ValueError(f"engine weight format {q!r} is unknown to the weight sync")
    return RolloutQuantizer(q["quantization"], format_named(q["format"]), q["quantization"].endswith("_qdq"))


def quantized_probe_tolerance(
    quantizer: RolloutQuantizer, model, dtype_tol: float, *, fp8_tol: float, nvfp4_tol: float
) -> float:
    """The probe's tolerance for quantized engines. The actor's probe runs its own forward: when
    that forward sees the engine's quantized values (dequantized engine weights, and an actor
    quantized alike: `actor.qat`, or its probe forward quantized, `probe_format`) the two compute
    the same thing and the rollout dtype's tolerance `dtype_tol` holds. Real FP8/FP4 kernels
    compute otherwise (vLLM's `fp8` method also quantizes activations; an actor whose layout
    splits a 128 x 128 tile probes unquantized): the format's own tolerance applies
    (`sync.probe_tol_fp8`, `sync.probe_tol_nvfp4`)."""
    alike = quantizer.fmt in (getattr(model, "qat_format", None), getattr(model, "probe_format", None))
    if quantizer.qdq and alike:
        return dtype_tol
    return fp8_tol if quantizer.fmt.kind == "fp8" else nvfp4_tol
