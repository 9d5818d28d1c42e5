"""FP8 rollout weights on the sync side: which quantizer the engines ask for, and wire dtypes.

The FP8 layout, the quantization primitives and the engine's FP8 folder live in `rollout.fp8`
(the engine prepares its FP8 checkpoint at start); at every sync the sender quantizes each load
unit with the quantizer `fp8_quantizer` picks from the engines' `info()`, and the buckets keep
FP8 weights and their fp32 scales in their own dtypes (`wire_dtype`).
"""

from __future__ import annotations

import json

import torch

from megatron_agent.rollout.fp8 import FP8_DTYPE, Fp8Quantizer


def wire_dtype(name: str, tensor: torch.Tensor, rollout_dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels in: FP8 weights and their fp32 scales keep theirs, the rest `rollout_dtype`."""
    if tensor.dtype == FP8_DTYPE or name.endswith((".weight_scale", ".weight_scale_inv")):
        return tensor.dtype
    return rollout_dtype


def fp8_quantizer(engine_infos: list[dict]) -> Fp8Quantizer | None:
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
    if q.get("method") != "fp8":
        raise ValueError(f"engine weight format {q!r} is unknown to the weight sync (only fp8 is)")
    return Fp8Quantizer(q["scales"])
