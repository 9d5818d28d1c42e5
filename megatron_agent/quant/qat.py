"""Quantization-aware training: the actor's forward computes with its decoder linear weights
fake-quantized by ModelOpt, exactly as the rollout engines receive them (`actor.qat`).

Every linear layer of the decoder (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2` of
the local spec) gets a forward wrapper that swaps in the fake-quantized weight for the call and
puts the parameter back after it; a straight-through function makes the gradient of the
quantized weight the parameter's gradient. The optimizer, DDP, checkpoints and the weight sync see
the unquantized parameters, so a checkpoint, a resume or an export is the same as without QAT.

The engines quantize each HF tensor (q, k, v, o, gate, up, down) on its own, from the whole tensor
(`sync.quantizer`). Here a rank holds one tensor-parallel shard of a fused Megatron weight: it
splits the shard into its pieces of those HF tensors (a shard of `linear_qkv` holds a contiguous
range of q's, k's and v's rows; of `linear_fc1`, of gate's and up's; of a row-parallel layer, a
range of columns), takes each HF tensor's amax over the tensor-parallel group (one all-reduce per
layer; for NVFP4 the largest of a fused layer's pieces, as the engines quantize: quant/layout.py),
and fake-quantizes each piece with it (`quant.ops.fake_quantize(global_amax=...)`). For
per-tensor FP8 and for NVFP4 (16-wide blocks along a row, a per-tensor second scale) that is
bit for bit the whole tensor's quantization restricted to the piece (tests/quant/test_qat.py);
for 128 x 128 FP8 tiles it is when every piece starts on a tile boundary, which `enable_qat`
checks (and refuses otherwise, naming the layout).

A quantized rollout without `actor.qat` wraps the layers switched off: the weight sync's probe
switches them on for its forward (`quantized_forward`), so it checks the sync (at the rollout
dtype's tolerance for a `*_qdq` engine) instead of measuring the quantization's policy gap.

Not done: the Transformer Engine spec (its fused modules read their weights inside TE; refused at
load), and runs on GPU (the fused weight-gradient path keeps working through `main_grad`, which
the quantized weight carries, but this has not run on a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from megatron_agent.models.hf_config import ModelArch
from megatron_agent.quant.formats import QuantFormat
from megatron_agent.quant.ops import fake_quantize
from megatron_agent.weights.mapping import ParamRule, full_to_hf, hf_to_full

# The decoder's linear layers and how their weight splits into HF tensors.
_KINDS = {"linear_qkv": "qkv", "linear_proj": "row", "linear_fc1": "gate_up", "linear_fc2": "row"}


class _StraightThrough(torch.autograd.Function):
    """Forward: the fake-quantized weight (exactly); backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, weight, quantize):
        return quantize(weight.detach())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class QatLinear:
    """The forward of one Megatron linear layer with its weight fake-quantized."""

    def __init__(
        self,
        module: torch.nn.Module,
        kind: str,
        fmt: QuantFormat,
        arch: ModelArch,
        tp_size: int,
        active: bool,
    ):
        self.module, self.kind, self.fmt, self.arch, self.tp = module, kind, fmt, arch, tp_size
        self.active = active
        self.inner = module.forward
        module.forward = self  # an instance attribute: nn.Module.__call__ now calls this

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.inner(*args, **kwargs)
        module = self.module
        param = module._parameters["weight"]
        quantized = _StraightThrough.apply(param, self.quantize)
        if hasattr(param, "main_grad"):  # Megatron's fused weight-gradient accumulation (GPU)
            quantized.main_grad = param.main_grad
        module._parameters["weight"] = quantized
        try:
            return self.inner(*args, **kwargs)
        finally:
            module._parameters["weight"] = param

    @torch.no_grad()
    def quantize(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's shard fake-quantized piece by piece with the HF tensors' global amaxes."""
        pieces = split_pieces(self.kind, local, self.arch, self.tp)
        amax = torch.stack([p.abs().amax().float() for p in pieces])
        if self.tp > 1:
            from megatron.core import parallel_state as ps

            torch.distributed.all_reduce(
                amax, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group()
            )
        if self.fmt.kind == "nvfp4":  # one second-level scale per fused layer (quant/layout.py)
            amax = amax.amax().expand(len(pieces))
        quantized = [fake_quantize(self.fmt, p, global_amax=a) for p, a in zip(pieces, amax)]
        return join_pieces(self.kind, quantized, self.arch, self.tp)


def _shard_arch(arch: ModelArch, tp: int) -> ModelArch:
    """The architecture one tensor-parallel shard looks like (its share of the heads and groups)."""
    return dataclasses.replace(
        arch, num_attention_heads=arch.num_attention_heads // tp, num_query_groups=arch.num_query_groups // tp
    )


def split_pieces(kind: str, local: torch.Tensor, arch: ModelArch, tp: int) -> list[torch.Tensor]:
    """A shard of a fused weight as its pieces of HF tensors: [q, k, v], [gate, up] or [itself]
    (the layout mapping's split, at the shard's share of the heads)."""
    return full_to_hf(ParamRule("", (), kind), local, _shard_arch(arch, tp))


def join_pieces(kind: str, pieces: list[torch.Tensor], arch: ModelArch, tp: int) -> torch.Tensor:
    """The inverse of `split_pieces`."""
    return hf_to_full(ParamRule("", (), kind), pieces, _shard_arch(arch, tp), padded_vocab=0)


def check_tile_alignment(fmt: QuantFormat, arch: ModelArch, tp: int) -> None:
    """Raise ValueError when a shard's pieces do not start on the format's block boundaries (so a
    shard's quantization would differ from the whole tensor's)."""
    if fmt.block is None or tp == 1:
        return
    rows, cols = fmt.block
    d = arch.head_dim
    starts = {  # (rows, columns) of one shard's piece of each HF tensor
        "q_proj rows": arch.num_attention_heads * d // tp,
        "k_proj/v_proj rows": arch.num_query_groups * d // tp,
        "gate_proj/up_proj rows": arch.ffn_hidden_size // tp,
    }
    bad = [f"{what} per shard {n} (a multiple of {rows} needed)" for what, n in starts.items() if n % rows]
    for what, n in {
        "o_proj columns": arch.num_attention_heads * d // tp,
        "down_proj columns": arch.ffn_hidden_size // tp,
    }.items():
        if n % cols:
            bad.append(f"{what} per shard {n} (a multiple of {cols} needed)")
    if bad:
        raise ValueError(
            f"actor.qat in format {fmt.name} at parallel.tp={tp}: a shard's pieces do not start on "
            f"{rows}x{cols} block boundaries ({'; '.join(bad)}), so the actor would quantize differently "
            "from the engines; use a tp that keeps them aligned"
            + (" or rollout.fp8_scales=tensor" if fmt.kind == "fp8" else "")
        )


def enable_qat(chunks: list, arch: ModelArch, fmt: QuantFormat, tp: int, *, active: bool = True) -> int:
    """Fake-quantize the decoder linear weights of every model chunk in their forward; returns how
    many linear layers were wrapped. `active=False` wraps them switched off (`quantized_forward`
    switches them on for a block). Raises ValueError when the layout cannot match the engines."""
    from megatron_agent.weights.export import unwrap

    check_tile_alignment(fmt, arch, tp)
    count = 0
    for chunk in chunks:
        for name, module in unwrap(chunk).named_modules():
            kind = _KINDS.get(name.rsplit(".", 1)[-1])
            if kind and ".layers." in f".{name}" and not isinstance(module.forward, QatLinear):
                QatLinear(module, kind, fmt, arch, tp, active)
                count += 1
    return count


@contextlib.contextmanager
def quantized_forward(chunks: list) -> Iterator[None]:
    """Within the block, the wrapped linear layers of `chunks` compute with quantized weights (the
    weight sync's probe of a quantized engine: the actor then computes with the engine's weights)."""
    from megatron_agent.weights.export import unwrap

    wrappers = [
        m.forward
        for chunk in chunks
        for m in unwrap(chunk).modules()
        if isinstance(m.__dict__.get("forward"), QatLinear)
    ]
    before = [w.active for w in wrappers]
    for w in wrappers:
        w.active = True
    try:
        yield
    finally:
        for w, was in zip(wrappers, before):
            w.active = was
