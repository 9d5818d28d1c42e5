"""Megatron GPT chunks on the meta device: the exact parameter layout and sharded state dict of
a model, without memory.

The streaming converters use these to ask Megatron itself how a model at a given TP/PP/VPP
layout names, shapes and shards its tensors (`chunk.sharded_state_dict()`), so a converted
checkpoint is laid out exactly like one saved from a live model. The local layer spec is used
everywhere: Megatron saves local and Transformer Engine models under the same keys.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from megatron_agent.models.build import BuildOptions, layer_spec, transformer_config
from megatron_agent.models.hf_config import ModelArch, padded_vocab_size


def build_meta_chunks(arch: ModelArch, opts: BuildOptions) -> list:
    """This pipeline rank's GPTModel chunks (one per virtual stage) with meta-device parameters.

    Mirrors `models.build.build_model_chunks` (same config, spec and GPTModel arguments); a test
    checks that both give the same sharded state dict.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    opts = dataclasses.replace(opts, transformer_impl="local", fp8="")
    config, _ = transformer_config(arch, opts)
    # Meta tensors need a factory call without an explicit device: CPU initialisation code path,
    # and no random initialisation (there is nothing to initialise).
    config = dataclasses.replace(config, use_cpu_initialization=True, perform_initialization=False)
    spec = layer_spec(arch, "local")
    num_chunks = opts.vpp if opts.vpp > 1 else 1
    if arch.num_layers % (opts.pp * num_chunks):
        raise ValueError(f"num_layers={arch.num_layers} is not divisible by pp*vpp={opts.pp * num_chunks}")
    chunks = []
    for vp_stage in range(num_chunks):
        stage = vp_stage if num_chunks > 1 else None
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            chunk = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=padded_vocab_size(arch.vocab_size, opts.tp),
                max_sequence_length=arch.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                parallel_output=True,
                share_embeddings_and_output_weights=arch.tied_embeddings,
                position_embedding_type="rope",
                rotary_base=int(arch.rope_theta),
                vp_stage=stage,
            )
        for name, param in chunk.named_parameters():
            assert param.is_meta, f"{name} was materialised on {param.device}"
        chunks.append(chunk)
    return chunks
