"""A `MegatronModel` (actor or reference) built for the current parallel state and loaded from HF.

It sits above both `models` (the model) and `weights` (the HF loader), which do not know each
other in this direction: the model has no loading code, the loader fills chunks it is given.
"""

from __future__ import annotations

from pathlib import Path

from megatron_agent.models.build import BuildOptions, build_model_chunks, resolve_transformer_impl
from megatron_agent.models.hf_config import arch_from_hf_config, load_hf_config
from megatron_agent.models.policy import MegatronModel, OptimConfig
from megatron_agent.models.value_model import HEAD_PREFIX, build_value_chunks, init_value_head
from megatron_agent.weights.load import load_hf_weights


def policy_from_hf(
    model_path: str | Path,
    opts: BuildOptions,
    *,
    trainable: bool = True,
    optim: OptimConfig | None = None,
) -> MegatronModel:
    """Build and load a model; a trainable one is DDP-wrapped and gets an optimizer.

    The model is built without random initialisation (the load fills every parameter, or
    fails naming the ones it could not), and each TP rank reads about its own shard only.
    """
    arch = arch_from_hf_config(load_hf_config(model_path))
    chunks = build_model_chunks(arch, opts, trainable=trainable, initialize=False)
    load_hf_weights(chunks, arch, model_path, impl=resolve_transformer_impl(opts.transformer_impl))
    model = MegatronModel(chunks, arch, opts, trainable=trainable)
    if trainable:
        model.wrap_for_training(optim or OptimConfig())
    return model


def critic_from_hf(
    model_path: str | Path, opts: BuildOptions, *, optim: OptimConfig | None = None, seed: int = 0
) -> MegatronModel:
    """Build a critic (models/value_model.py) from the actor's HF checkpoint: the transformer
    loaded as the actor's, the value head drawn with `seed`; DDP-wrapped with its optimizer."""
    arch = arch_from_hf_config(load_hf_config(model_path))
    chunks = build_value_chunks(arch, opts, initialize=False)
    impl = resolve_transformer_impl(opts.transformer_impl)
    load_hf_weights(chunks, arch, model_path, impl=impl, own_prefixes=(HEAD_PREFIX,))
    init_value_head(chunks, arch, seed)
    model = MegatronModel(chunks, arch, opts, trainable=True, head="values")
    model.wrap_for_training(optim or OptimConfig())
    return model
