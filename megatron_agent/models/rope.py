"""Rotary inverse frequencies exactly as HF computes them (default, linear and llama3 scaling).

Megatron's own llama3 scaling hard-codes low/high frequency factors and the original context
length (8192); a checkpoint with other values would be silently different. We compute the
inverse frequencies from the HF config and install them on the model's rotary embedding.
"""

from __future__ import annotations

import math

import torch

from megatron_agent.models.hf_config import ModelArch


def hf_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim / 2] in fp32 for `arch`, with its rope scaling."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope type {rope_type!r} has no implementation")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def install_inv_freq(model, arch: ModelArch) -> None:
    """Replace the rotary embedding's inverse frequencies of a Megatron GPTModel chunk."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        return
    device = rotary.inv_freq.device
    rotary.inv_freq = hf_inv_freq(arch).to(device)
    # Megatron memoises the rotary embedding per sequence length (lru_cache on forward).
    if hasattr(rotary.forward, "cache_clear"):
        rotary.forward.cache_clear()
