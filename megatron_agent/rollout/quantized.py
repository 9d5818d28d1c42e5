"""Quantized rollout on the engine's side: what `rollout.quantization` makes a vLLM engine serve.

- `fp8`, `nvfp4_w4a16` (GPU): vLLM's quantized kernels on real quantized weights. The HF folder is
  written once in the format's layout (`quant.hf_folder.write_quantized_folder`: vLLM's `fp8`
  method for FP8, ModelOpt's W4A16 NVFP4 for `modelopt_fp4`) and every sync then sends
  quantized data and scales (`sync.quantizer`).
- `fp8_qdq`, `nvfp4_qdq` (anywhere, the CPU tests and quickstart use them): the engine serves
  the same quantized values dequantized into its dtype. It starts from the model's own weights;
  the run's first sync, before any rollout, replaces them with the quantized ones.

Both quantize with ModelOpt (`megatron_agent.quant`) and open the same policy gap between the
rollout and the trainer, which truncated importance sampling corrects (`algorithm.rollout_is=auto`
turns it on) and `actor.qat` closes (the actor's forward sees the same quantized weights).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from megatron_agent.quant.formats import rollout_format

QUANTIZATIONS = ("", "fp8", "nvfp4_w4a16", "fp8_qdq", "nvfp4_qdq")
REAL = ("fp8", "nvfp4_w4a16")
"""Formats whose weights the engine computes with in their quantized form (GPU only)."""


def check_quantized_rollout_supported(quantization: str) -> None:
    """Raise ValueError naming what is missing where vLLM cannot serve `quantization` here."""
    if quantization not in REAL:
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"rollout.quantization={quantization} needs a CUDA GPU: vLLM's FP8 and FP4 kernels (tensor "
            "cores on compute capability >= 8.9, Marlin weight-only on 8.0-8.6) do not exist on CPU; "
            f"use rollout.quantization={quantization.split('_')[0]}_qdq here (the same quantized values, "
            "dequantized) or ''"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 0):
        raise ValueError(
            f"rollout.quantization={quantization} needs a GPU of compute capability >= 8.0; "
            f"{torch.cuda.get_device_name()} is {major}.{minor}"
        )


def prepare_quantized_engine(
    model_path: str | Path, quantization: str, fp8_scales: str, dtype: str, cache_dir: str | None
) -> tuple[Path, dict, str | None]:
    """(the folder vLLM starts from, the engine's `quantization` info for the sync, vLLM's
    `quantization` argument or None). Writes the quantized folder for a real format.

    Raises ValueError naming the setting or what is missing (no GPU, an fp32 rollout, a bad name).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"rollout.quantization={quantization!r}: choose one of {QUANTIZATIONS}")
    fmt, qdq = rollout_format(quantization, fp8_scales)
    info = {"quantization": quantization, "format": fmt.name}
    if qdq:
        return Path(model_path), info, None
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(
            f"rollout.quantization={quantization} runs activations in bf16 or fp16; model.dtype gives {dtype}"
        )
    check_quantized_rollout_supported(quantization)
    from megatron_agent.quant.hf_folder import vllm_quantization_name, write_quantized_folder

    root = Path(cache_dir) if cache_dir else Path(tempfile.mkdtemp(prefix="megatron-agent-quant-"))
    folder = write_quantized_folder(model_path, root / f"{fmt.name}_{Path(model_path).name}", fmt)
    return folder, info, vllm_quantization_name(fmt)
