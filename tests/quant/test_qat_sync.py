"""Quantized weights through the real sync and in the actor's forward (QAT), at TP1PP1 and TP2PP2
(real gloo ranks; the engine is a recording process that asks for `*_qdq` weights like a vLLM
engine started with `rollout.quantization=<format>_qdq` does).

- What the engine is given to load equals ModelOpt's quantization (its `FP8QTensor` /
  `NVFP4QTensor`, quantize then dequantize; NVFP4 with a fused group's common amax) of the
  actor's HF weights, bit for bit; every other tensor is the actor's own.
- With `enable_qat`, the Megatron actor's log-probs equal those of the HF model whose linear
  weights were quantized by ModelOpt (1e-4, fp32): each TP shard quantized with its HF tensor's
  global amax is the whole tensor's quantization.
- The straight-through gradient moves every weight, the quantized linear ones included.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_torchrun
from tests.helpers.mp_logprobs_worker import sequences

LAYOUTS = {"1x1": "qwen2", "2x2": "qwen3"}  # qwen3: q/k norm, head_dim != hidden / heads


@pytest.fixture(scope="module")
def launch(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("qat_sync")
    run_torchrun(
        [
            "tests/quant/qat_sync_worker.py",
            "--layouts",
            *(f"{layout}={tiny_models[name]}" for layout, name in LAYOUTS.items()),
            "--out-dir",
            str(out),
        ],
        nproc=4,
        timeout=900,
    )
    return json.loads((out / "results.json").read_text()), out


def _modelopt_qdq(name: str, w: torch.Tensor, group_amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's own quantize-dequantize of one weight, called directly (the reference); NVFP4's
    second-level scale from the amax of the weight's fused group (q/k/v, gate/up), as ModelOpt's
    export and vLLM's fused layers have it."""
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    w = w.float()
    if name == "fp8":
        q, scale = FP8QTensor.quantize(w)
        return q.dequantize(dtype=torch.float32, scale=scale)
    second = group_amax.float() / (6 * 448)
    q, block, second = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=second)
    return q.dequantize(dtype=torch.float32, scale=block, double_scale=second, block_sizes={-1: 16})


def _quantized_state(fmt: str, state: dict) -> dict:
    """`state`'s linear weights quantized by `_modelopt_qdq`, the rest as it is."""
    from megatron_agent.quant.formats import is_quantized_linear
    from megatron_agent.quant.layout import fused_group

    out = {}
    for name, w in state.items():
        if not is_quantized_linear(name):
            out[name] = w
            continue
        group_amax = torch.stack([state[n].abs().amax() for n in fused_group(name)]).amax()
        out[name] = _modelopt_qdq(fmt, w, group_amax)
    return out


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_engine_is_given_modelopts_quantized_actor_weights_bit_for_bit(launch, layout, fmt):
    from safetensors.torch import load_file

    from megatron_agent.quant.formats import is_quantized_linear

    _, out = launch
    key = f"{layout}_{fmt}"
    actor = load_file(str(out / f"{key}_actor.safetensors"))
    given = {}
    for path in sorted((out / key).glob("bucket*.safetensors")):
        given.update(load_file(str(path)))
    assert set(given) == set(actor)
    quantized = [n for n in actor if is_quantized_linear(n)]
    layers = {n.split(".")[2] for n in actor if n.startswith("model.layers.")}
    assert len(quantized) == 7 * len(layers)  # q, k, v, o, gate, up, down in every layer
    reference = _quantized_state(fmt, actor)
    for name, tensor in given.items():
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name
        if name in quantized:
            assert not torch.equal(tensor, actor[name]), name  # quantized, not passed through


def _hf_logprobs(model_path, fmt: str) -> list[torch.Tensor]:
    """The HF model's log-probs of the test sequences, its linear weights quantized in `fmt` ('': not)."""
    from transformers import AutoModelForCausalLM

    from megatron_agent.quant.formats import is_quantized_linear

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    with torch.no_grad():
        if fmt:
            quantized = _quantized_state(fmt, {n: p.detach().clone() for n, p in model.named_parameters()})
            for name, param in model.named_parameters():
                if is_quantized_linear(name):
                    param.copy_(quantized[name])
        out = []
        for seq in sequences():
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits.float()[0, :-1], dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
    return out


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_qat_actor_computes_with_the_quantized_weights(launch, tiny_models, layout, fmt):
    results, _ = launch
    record = results[f"{layout}/{fmt}"]
    layers = json.loads((tiny_models[LAYOUTS[layout]] / "config.json").read_text())["num_hidden_layers"]
    assert record["wrapped"] == 4 * layers // (2 if layout == "2x2" else 1)  # 4 linears a layer, a stage's
    plain = _hf_logprobs(tiny_models[LAYOUTS[layout]], fmt="")
    for mine, ref, unquantized in zip(
        record["logprobs"], _hf_logprobs(tiny_models[LAYOUTS[layout]], fmt), plain
    ):
        mine = torch.tensor(mine)
        assert (mine - ref).abs().max() < 1e-4
        assert (mine - unquantized).abs().max() > 1e-3  # the quantization shows in the log-probs


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_the_straight_through_gradient_moves_every_weight(launch, fmt):
    from safetensors.torch import load_file

    results, out = launch
    for layout in LAYOUTS:
        actor = load_file(str(out / f"{layout}_{fmt}_actor.safetensors"))
        assert sorted(results[f"{layout}/{fmt}"]["moved"]) == sorted(actor), layout
