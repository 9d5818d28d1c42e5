"""Megatron GPT chunks on the meta device: the exact parameter layout and sharded state dict of
a model, without memory.

The streaming converters use these to ask Megatron itself how a model at a given TP/PP/VPP
layout names, shapes and shards its tensors (`chunk.sharded_state_dict()`), so a converted
checkpoint is laid out exactly like one saved from a live model. The local layer spec is used
everywhere: Megatron saves local and Transformer Engine models under the same keys.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_agent.models.build import (
    BuildOptions,
    gpt_model_chunk,
    layer_spec,
    num_virtual_stages,
    transformer_config,
)
from megatron_agent.models.hf_config import ModelArch


def build_meta_chunks(arch: ModelArch, opts: BuildOptions) -> list:
    """This pipeline rank's GPTModel chunks (one per virtual stage) with meta-device parameters.

    Built by the same `models.build` functions as live models (same config, spec and GPTModel
    arguments); a test checks that both give the same sharded state dict.
    """
    opts = dataclasses.replace(opts, transformer_impl="local", fp8="")
    config, _ = transformer_config(arch, opts)
    # Meta tensors need a factory call without an explicit device: CPU initialisation code path,
    # and no random initialisation (there is nothing to initialise).
    config = dataclasses.replace(config, use_cpu_initialization=True, perform_initialization=False)
    spec = layer_spec(arch, "local")
    num_chunks = num_virtual_stages(arch, opts)
    chunks = []
    for vp_stage in range(num_chunks):
        with torch.device("meta"):
            chunk = gpt_model_chunk(arch, opts, config, spec, vp_stage if num_chunks > 1 else None)
        for name, param in chunk.named_parameters():
            assert param.is_meta, f"{name} was materialised on {param.device}"
        chunks.append(chunk)
    return chunks
