"""Fast start: a model built without random initialisation and filled from per-rank slices of the
HF tensors is exactly the model of the old build (random init, full tensors assembled and
split), and a load that would leave a parameter unfilled is an error naming it.

One torchrun launch (4 gloo ranks) runs TP1PP1 and TP2PP2 for every family; assertions run here.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_agent.models.hf_config import ModelArch
from megatron_agent.weights.load import fill_from_hf
from megatron_agent.weights.mapping import ParamRule, hf_to_full, shard
from tests.conftest import run_torchrun

FAMILIES = ["llama_tied", "llama_untied", "qwen2", "qwen3"]
LAYOUTS = ["1x1", "2x2"]
DROPPED = "model.layers.1.self_attn.k_proj.bias"


@pytest.fixture(scope="module")
def results(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("fast_build")
    broken = shutil.copytree(tiny_models["qwen2"], root / "qwen2_missing")
    tensors = load_file(broken / "model.safetensors")
    del tensors[DROPPED]
    save_file(tensors, broken / "model.safetensors")
    out = root / "results.json"
    models = [str(tiny_models[n]) for n in FAMILIES]
    run_torchrun(
        ["tests/models/fast_build_worker.py", "--models", *models, "--layouts", *LAYOUTS]
        + ["--missing-tensor-model", str(broken), "--ckpt-dir", str(root / "ckpt"), "--out", str(out)],
        nproc=4,
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_fast_build_logprobs_equal_old_build(results, name, layout):
    lps = results["logprobs"][f"{name}/{layout}"]
    assert len(lps["fast"]) == len(lps["old"]) == 5
    for fast, old in zip(lps["fast"], lps["old"]):
        fast, old = torch.tensor(fast, dtype=torch.float32), torch.tensor(old, dtype=torch.float32)
        assert torch.isfinite(fast).all() and (fast < 0).all()
        assert torch.equal(fast, old), (name, layout, (fast - old).abs().max())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_fast_build_parameters_equal_old_build(results, name, layout):
    # Every parameter of every rank, bitwise (log-probs alone could miss e.g. padded vocab rows).
    assert results["params_differ"][f"{name}/{layout}"] == []
    assert all(n > 0 for n in results["num_params"][f"{name}/{layout}"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fast_build_runs_no_random_initialisation(results, layout):
    # Rank 0's CPU RNG (Megatron's init draws from it on CPU) is untouched by the fast build and
    # advanced by the old one.
    for name in FAMILIES:
        assert results["rng_drawn"][f"{name}/{layout}"] == {"fast": False, "old": True}, name


def test_checkpoint_loads_into_a_model_built_without_init(results):
    # qwen3 at TP2PP2: saved from the fast build, loaded by `checkpoint.load_checkpoint` into
    # uninitialised chunks (the verify / resume path), every parameter bitwise equal.
    assert results["checkpoint_params_differ"] == []


def test_missing_tensor_names_tensor_and_unfilled_parameter(results):
    for rank_errors in results["errors"]:
        kind, message = rank_errors["missing_tensor"]
        assert kind == "CheckpointMismatchError", message
        assert f"missing tensors: {DROPPED} (for decoder.layers.1.self_attention.linear_qkv.bias" in message


def test_parameter_left_unfilled_is_named(results):
    # Rank order is (pp, tp) major-minor: ranks 0, 1 hold the first stage, 2, 3 the last.
    for rank_errors in results["errors"]:
        kind, message = rank_errors["unfilled_parameter"]
        assert kind == "UnfilledParameterError", message
        assert "left 1 parameter(s) unfilled: chunk0.decoder.extra_scale" in message


# ---- the slice reader against the full-tensor transforms, every rule kind -------------------

ARCH = ModelArch(
    family="qwen2",
    architecture="Qwen2ForCausalLM",
    vocab_size=50,
    hidden_size=24,
    ffn_hidden_size=40,
    num_layers=1,
    num_attention_heads=6,
    num_query_groups=2,
    head_dim=4,
    norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling={},
    max_position_embeddings=64,
    tied_embeddings=False,
    qkv_bias=True,
    qk_norm=False,
)


def _hf_tensors(kind: str, gen: torch.Generator) -> list[torch.Tensor]:
    h, f, d = ARCH.hidden_size, ARCH.ffn_hidden_size, ARCH.head_dim
    q, kv = ARCH.num_attention_heads * d, ARCH.num_query_groups * d
    shapes = {
        "replicated": [(h,)],
        "column": [(f, h)],
        "row": [(h, f)],
        "vocab": [(ARCH.vocab_size, h)],
        "gate_up": [(f, h), (f, h)],
        "qkv": [(q, h), (kv, h), (kv, h)],
        "qkv_bias": [(q,), (kv,), (kv,)],
    }[kind]
    return [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["replicated", "column", "row", "vocab", "gate_up", "qkv", "qkv_bias"])
def test_fill_from_hf_equals_full_then_shard(kind, tp):
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(tp)
    tensors = _hf_tensors(kind, gen)
    rule = ParamRule("p", tuple(f"t{j}" for j in range(len(tensors))), kind.removesuffix("_bias"))
    padded = 128 * tp
    full = hf_to_full(rule, tensors, ARCH, padded)
    for rank in range(tp):
        want = shard(rule, full, rank, tp).float()
        got = torch.full_like(want, float("nan"))
        fill_from_hf(got, rule, tensors, ARCH, rank, tp)
        assert torch.equal(got, want), (kind, tp, rank)
    # The same through safetensors' lazy slices of a file.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        save_file({n: t for n, t in zip(rule.hf, tensors)}, f"{tmp}/m.safetensors")
        with safe_open(f"{tmp}/m.safetensors", framework="pt") as fh:
            got = torch.full_like(want, float("nan"))
            fill_from_hf(got, rule, [fh.get_slice(n) for n in rule.hf], ARCH, tp - 1, tp)
            assert torch.equal(got, shard(rule, full, tp - 1, tp).float())


def test_fill_from_hf_rejects_a_wrong_shape():
    from megatron_agent.weights.load import CheckpointMismatchError

    rule = ParamRule("decoder.layers.0.mlp.linear_fc2.weight", ("down",), "row")
    dst = torch.empty(ARCH.hidden_size, ARCH.ffn_hidden_size // 2)
    # 41 columns: a [:, 20:40] slice would fit, silently dropping one column.
    with pytest.raises(CheckpointMismatchError, match=r"down has shape \(24, 41\).*needs \(24, 40\)"):
        fill_from_hf(dst, rule, [torch.zeros(24, 41)], ARCH, 1, 2)
