"""Build Megatron-core GPT models (actor and reference) from an HF architecture.

The layer spec is Transformer Engine's where TE and a GPU are present and the portable local
spec otherwise; FP8 needs TE (a clear error elsewhere). Models are built for the current
parallel state: each pipeline rank gets its stage (a list of virtual-pipeline chunks).
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_agent.models.hf_config import ModelArch, padded_vocab_size
from megatron_agent.models.rope import install_inv_freq
from megatron_agent.platform.setup import device as compute_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class BuildOptions:
    """How to build the Megatron model (independent of the architecture)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dtype: str = "fp32"
    fp8: str = ""
    transformer_impl: str = "auto"
    sequence_parallel: bool = False
    recompute: str = "none"
    """Activation recomputation: 'none', 'selective' (core attention) or 'full' (every layer)."""


def te_available() -> bool:
    """True where Transformer Engine can be used (installed and a CUDA GPU present)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def resolve_transformer_impl(requested: str) -> str:
    """'te' or 'local' for the requested impl ('auto', 'te', 'local')."""
    if requested == "auto":
        return "te" if te_available() else "local"
    if requested == "te" and not te_available():
        raise ValueError(
            "model.transformer_impl=te needs Transformer Engine and a CUDA GPU; use 'local' or 'auto'"
        )
    if requested not in ("te", "local"):
        raise ValueError(f"model.transformer_impl={requested!r}: choose auto, te or local")
    return requested


def transformer_config(arch: ModelArch, opts: BuildOptions, *, initialize: bool = True):
    """The Megatron `TransformerConfig` reproducing `arch` exactly (no dropout, no fusions on CPU).

    `initialize=False` turns Megatron's weight initialisation off (for models whose weights are
    loaded next): parameters are allocated but hold whatever memory they were given.
    """
    from megatron.core.transformer import TransformerConfig

    if opts.dtype not in DTYPES:
        raise ValueError(f"dtype={opts.dtype!r}: choose one of {sorted(DTYPES)}")
    impl = resolve_transformer_impl(opts.transformer_impl)
    fp8_kwargs = {}
    if opts.fp8:
        if opts.fp8 not in FP8_RECIPES:
            raise ValueError(f"model.fp8={opts.fp8!r}: choose one of {FP8_RECIPES} (or '' for off)")
        if impl != "te":
            raise ValueError(
                "model.fp8 needs Transformer Engine on a GPU; it is not available on this machine"
            )
        fp8_kwargs = dict(fp8="hybrid", fp8_recipe=opts.fp8)
    if opts.sequence_parallel and opts.tp == 1:
        raise ValueError("parallel.sequence_parallel=true needs tensor parallelism: set parallel.tp > 1")
    dtype = DTYPES[opts.dtype]
    on_gpu = torch.cuda.is_available()
    pp2_interleaved = opts.pp == 2 and opts.vpp > 1  # see variable_seq_lengths below
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=opts.tp,
        pipeline_model_parallel_size=opts.pp,
        virtual_pipeline_model_parallel_size=opts.vpp if opts.vpp > 1 else None,
        sequence_parallel=opts.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not on_gpu,
        perform_initialization=initialize,
        # A tied last pipeline stage copies the embedding from the first one with an all-reduce
        # at construction; this flag skips it, and the load fills that copy itself. (Its only
        # other effect is Transformer Engine's meta device, so it is set for the local spec only.)
        init_model_with_meta_device=not initialize and impl == "local",
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # At PP2 with VPP a rank's previous and next stage are the same rank, and in the
        # interleaved steady state an activation and a gradient cross between the two ranks in
        # one exchange. Batched p2p ops (send_prev, recv_prev, send_next, recv_next) match them
        # in posting order and swap them: the training forward silently ran on the wrong tensors
        # (measured over gloo). There, shapes are not exchanged (forward_backward pads every
        # micro-batch to one shape) and the unbatched ops send each direction on its own group.
        variable_seq_lengths=not pp2_interleaved,
        batch_p2p_comm=not pp2_interleaved,
        moe_token_dispatcher_type="alltoall",
        batch_p2p_sync=on_gpu,
        deallocate_pipeline_outputs=False,
        # Losses are normalised by global token/sequence counts by the caller (rl.aggregate);
        # this stops the schedule and DDP from also dividing by micro-batches or DP size.
        calculate_per_token_loss=True,
        **recompute_kwargs(opts.recompute),
        **fp8_kwargs,
    ), impl


def recompute_kwargs(recompute: str) -> dict:
    """TransformerConfig fields for `model.recompute` ('none', 'selective' or 'full').

    'selective' recomputes core attention (Megatron's default module list) in the backward pass;
    'full' recomputes every transformer layer from its input (one layer per checkpoint).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"model.recompute={recompute!r}: choose one of {RECOMPUTE}")
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {}


def layer_spec(arch: ModelArch, impl: str):
    """The transformer layer spec: Transformer Engine's or the local one."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if impl == "te":
            return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
        spec = specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    from megatron_agent.models.sdpa_attention import SDPAttention

    # the same attention through PyTorch's fused kernel (models/sdpa_attention.py)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def num_virtual_stages(arch: ModelArch, opts: BuildOptions) -> int:
    """Model chunks per pipeline rank (1 without VPP); checks that the layers divide evenly."""
    num_chunks = opts.vpp if opts.vpp > 1 else 1
    if arch.num_layers % (opts.pp * num_chunks):
        raise ValueError(f"num_layers={arch.num_layers} is not divisible by pp*vpp={opts.pp * num_chunks}")
    return num_chunks


def gpt_model_chunk(arch: ModelArch, opts: BuildOptions, config, spec, vp_stage: int | None):
    """One GPTModel chunk of this pipeline rank for virtual stage `vp_stage` (None without VPP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(arch.vocab_size, opts.tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            vp_stage=vp_stage,
        )


def build_model_chunks(
    arch: ModelArch, opts: BuildOptions, *, trainable: bool = True, initialize: bool = True
) -> list:
    """This pipeline rank's GPTModel chunks (one per virtual stage), on the compute device.

    `initialize=True` initialises the parameters randomly (a model made from scratch).
    `initialize=False` is for a model whose weights are loaded next (`weights.load_hf_weights`,
    `checkpoint.load_checkpoint`): no init kernels run and, on CPU, no full weight is initialised
    before slicing; the parameters are uninitialised memory until the load fills every one (both
    loads fail naming any parameter they did not fill). `trainable=False` freezes every
    parameter (the reference model).
    """
    config, impl = transformer_config(arch, opts, initialize=initialize)
    spec = layer_spec(arch, impl)
    num_chunks = num_virtual_stages(arch, opts)
    device = compute_device()
    chunks = []
    for vp_stage in range(num_chunks):
        model = gpt_model_chunk(arch, opts, config, spec, vp_stage if num_chunks > 1 else None)
        install_inv_freq(model, arch)
        model.to(device)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        chunks.append(model)
    return chunks
