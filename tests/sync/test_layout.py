"""The shared-memory layout: TP ranks writing their own shards rebuild exactly the exporter's HF tensors.

For every rule of the mapping table (QKV with GQA, its bias, gate/up, row- and column-parallel,
the padded vocabulary, replicated norms) at TP 1, 2 and 4, random Megatron shards are written
run by run into HF tensors; the result must equal (`torch.equal`) what `full_to_hf(unshard(...))`,
the exporter's path, gives. No process group is needed: the runs depend on shapes only.
"""

from __future__ import annotations

import pytest
import torch

from megatron_agent.models.hf_config import ModelArch
from megatron_agent.sync.layout import tensor_runs
from megatron_agent.weights.mapping import full_to_hf, global_rules, layer_rules, shard, unshard

ARCH = ModelArch(
    family="qwen2",
    architecture="Qwen2ForCausalLM",
    num_layers=1,
    hidden_size=16,
    ffn_hidden_size=24,
    num_attention_heads=8,
    num_query_groups=4,
    head_dim=4,
    vocab_size=30,
    max_position_embeddings=64,
    norm_eps=1e-6,
    rope_theta=1e4,
    qkv_bias=True,
    qk_norm=True,
)
PADDED_VOCAB = 32


def _full_shape(rule) -> tuple[int, ...]:
    a = ARCH
    qkv_rows = a.num_query_groups * (a.heads_per_group + 2) * a.head_dim
    return {
        "embedding.word_embeddings.weight": (PADDED_VOCAB, a.hidden_size),
        "output_layer.weight": (PADDED_VOCAB, a.hidden_size),
        "decoder.final_layernorm.weight": (a.hidden_size,),
        "decoder.layers.{i}.input_layernorm.weight": (a.hidden_size,),
        "decoder.layers.{i}.pre_mlp_layernorm.weight": (a.hidden_size,),
        "decoder.layers.{i}.self_attention.linear_qkv.weight": (qkv_rows, a.hidden_size),
        "decoder.layers.{i}.self_attention.linear_qkv.bias": (qkv_rows,),
        "decoder.layers.{i}.self_attention.linear_proj.weight": (
            a.hidden_size,
            a.num_attention_heads * a.head_dim,
        ),
        "decoder.layers.{i}.mlp.linear_fc1.weight": (2 * a.ffn_hidden_size, a.hidden_size),
        "decoder.layers.{i}.mlp.linear_fc2.weight": (a.hidden_size, a.ffn_hidden_size),
        "decoder.layers.{i}.self_attention.q_layernorm.weight": (a.head_dim,),
        "decoder.layers.{i}.self_attention.k_layernorm.weight": (a.head_dim,),
    }[rule.megatron]


RULES = global_rules(ARCH) + layer_rules(ARCH)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("rule", RULES, ids=[r.megatron.split(".")[-2] for r in RULES])
def test_runs_rebuild_the_exported_tensors(rule, tp):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(_full_shape(rule), generator=g)
    shards = [shard(rule, full, r, tp) for r in range(tp)]
    expected = full_to_hf(rule, unshard(rule, shards), ARCH)
    planned = tensor_runs(rule, 0, tuple(shards[0].shape), ARCH, tp)
    assert len(planned) == len(expected)
    for (name, shape, by_rank), want in zip(planned, expected):
        got = torch.full(shape, float("nan"))
        for r, runs in enumerate(by_rank):
            for run in runs:
                src = shards[r]
                if run.dim == 0:
                    got[run.dst : run.dst + run.length] = src[run.src : run.src + run.length]
                else:
                    got[:, run.dst : run.dst + run.length] = src[:, run.src : run.src + run.length]
        assert torch.equal(got, want), name
        if rule.kind == "replicated" and tp > 1:
            assert all(not runs for runs in by_rank[1:]), f"{name}: a replicated tensor is written once"
