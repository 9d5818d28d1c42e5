"""Weight quantization with NVIDIA ModelOpt: the formats (`formats.py`) and ModelOpt's quantize,
dequantize and fake-quantize of one weight (`ops.py`), used by the rollout's weight sync
(`sync/quantizer.py`), quantization-aware training of the actor (`qat.py`) and the quantized
export (`tools/convert/megatron_to_hf.py --quantize`). docs/quantization.md has the whole story.

ModelOpt (`nvidia-modelopt`) is imported only where a format is used: its import takes seconds.
"""

from megatron_agent.quant.formats import (
    QUANTIZED_LINEAR,
    QuantFormat,
    format_named,
    is_quantized_linear,
    rollout_format,
)

__all__ = ["QUANTIZED_LINEAR", "QuantFormat", "format_named", "is_quantized_linear", "rollout_format"]
