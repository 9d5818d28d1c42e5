"""THE mapping between HF and Megatron-core parameter names and layouts (Llama, Qwen2/2.5, Qwen3).

One table, used by checkpoint loading, `tools/convert` and the per-iteration rollout weight sync,
so they can never disagree. Each `ParamRule` names a Megatron parameter, the HF tensor(s) it is
made of, and how the full (unsharded) tensor is split over tensor-parallel ranks:

- `replicated`: the same on every TP rank (norms, q/k norms).
- `column`: split along dim 0 (output features).
- `row`: split along dim 1 (input features).
- `vocab`: split along dim 0 after padding the vocabulary rows to Megatron's padded size.
- `qkv`: q, k, v fused per query group: for each group g, [q heads of g; k_g; v_g] (NOT a plain
  concatenation of q, k, v, which is wrong under GQA). TP splits whole groups.
- `gate_up`: gate and up fused; each TP rank holds [gate shard; up shard].

Full tensors are in Megatron's layout; `hf_to_full` / `full_to_hf` convert between that and HF
tensors; `shard` / `unshard` split and join the TP pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_agent.models.hf_config import ModelArch


@dataclass(frozen=True)
class ParamRule:
    """One Megatron parameter and the HF tensors it comes from ({i} is the layer index)."""

    megatron: str
    hf: tuple[str, ...]
    kind: str

    def fill(self, layer: int | None) -> tuple[str, tuple[str, ...]]:
        """The concrete Megatron and HF names for a layer (layer=None for non-layer rules)."""
        if layer is None:
            return self.megatron, self.hf
        return self.megatron.format(i=layer), tuple(h.format(i=layer) for h in self.hf)


# Megatron names of the local spec; the TE spec fuses the norms into the following linear layer.
_LOCAL_NORM_NAMES = {
    "input_layernorm": "decoder.layers.{i}.input_layernorm.weight",
    "pre_mlp_layernorm": "decoder.layers.{i}.pre_mlp_layernorm.weight",
}
_TE_NORM_NAMES = {
    "input_layernorm": "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm": "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",
}


def global_rules(arch: ModelArch) -> list[ParamRule]:
    """Rules for the parameters outside the transformer layers."""
    rules = [
        ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    ]
    if not arch.tied_embeddings:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


def layer_rules(arch: ModelArch, impl: str = "local") -> list[ParamRule]:
    """Rules for the parameters of transformer layer {i}."""
    norms = _TE_NORM_NAMES if impl == "te" else _LOCAL_NORM_NAMES
    hf = "model.layers.{i}."
    qkv = tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv")
    rules = [
        ParamRule(norms["input_layernorm"], (hf + "input_layernorm.weight",), "replicated"),
        ParamRule("decoder.layers.{i}.self_attention.linear_qkv.weight", qkv, "qkv"),
        ParamRule(
            "decoder.layers.{i}.self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "row"
        ),
        ParamRule(norms["pre_mlp_layernorm"], (hf + "post_attention_layernorm.weight",), "replicated"),
        ParamRule(
            "decoder.layers.{i}.mlp.linear_fc1.weight",
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
            "gate_up",
        ),
        ParamRule("decoder.layers.{i}.mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row"),
    ]
    if arch.qkv_bias:
        bias = tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv")
        rules.append(ParamRule("decoder.layers.{i}.self_attention.linear_qkv.bias", bias, "qkv"))
    if arch.qk_norm:
        rules.append(
            ParamRule(
                "decoder.layers.{i}.self_attention.q_layernorm.weight",
                (hf + "self_attn.q_norm.weight",),
                "replicated",
            )
        )
        rules.append(
            ParamRule(
                "decoder.layers.{i}.self_attention.k_layernorm.weight",
                (hf + "self_attn.k_norm.weight",),
                "replicated",
            )
        )
    return rules


def all_hf_names(arch: ModelArch) -> list[str]:
    """Every HF tensor name the model has (tied models have no lm_head.weight)."""
    names = [h for r in global_rules(arch) for h in r.hf]
    for i in range(arch.num_layers):
        names += [h for r in layer_rules(arch) for h in r.fill(i)[1]]
    return names


# ---- full-tensor transforms ------------------------------------------------------------------


def hf_to_full(
    rule: ParamRule, hf_tensors: list[torch.Tensor], arch: ModelArch, padded_vocab: int
) -> torch.Tensor:
    """Combine the HF tensors of `rule` into the full Megatron tensor."""
    if rule.kind == "qkv":
        return _interleave_qkv(*hf_tensors, arch)
    if rule.kind == "gate_up":
        return torch.cat(hf_tensors, dim=0)
    (t,) = hf_tensors
    if rule.kind == "vocab":
        if t.shape[0] != arch.vocab_size:
            raise ValueError(f"{rule.hf[0]} has {t.shape[0]} rows, config vocab_size is {arch.vocab_size}")
        pad = padded_vocab - t.shape[0]
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    return t


def full_to_hf(rule: ParamRule, full: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    """Split a full Megatron tensor into the HF tensors of `rule` (padded vocab rows dropped)."""
    if rule.kind == "qkv":
        return _split_qkv(full, arch)
    if rule.kind == "gate_up":
        return list(torch.chunk(full, 2, dim=0))
    if rule.kind == "vocab":
        return [full[: arch.vocab_size]]
    return [full]


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    groups, per_group, d = arch.num_query_groups, arch.heads_per_group, arch.head_dim
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(groups, per_group * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per_group + 2) * d, *tail)


def _split_qkv(full: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    groups, per_group, d = arch.num_query_groups, arch.heads_per_group, arch.head_dim
    tail = full.shape[1:]
    g = full.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = torch.split(g, [per_group * d, d, d], dim=1)
    return [t.reshape(-1, *tail).contiguous() for t in (q, k, v)]


# ---- tensor-parallel split rules -------------------------------------------------------------


def shard(rule: ParamRule, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's piece of a full Megatron tensor."""
    if rule.kind == "replicated" or tp_size == 1:
        return full
    if rule.kind in ("column", "vocab", "qkv"):
        return torch.chunk(full, tp_size, dim=0)[tp_rank]
    if rule.kind == "row":
        return torch.chunk(full, tp_size, dim=1)[tp_rank]
    if rule.kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]])
    raise AssertionError(f"unknown rule kind {rule.kind}")


def unshard(rule: ParamRule, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from all TP ranks' pieces (in rank order)."""
    if rule.kind == "replicated" or len(shards) == 1:
        return shards[0]
    if rule.kind in ("column", "vocab", "qkv"):
        return torch.cat(shards, dim=0)
    if rule.kind == "row":
        return torch.cat(shards, dim=1)
    if rule.kind == "gate_up":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    raise AssertionError(f"unknown rule kind {rule.kind}")
