"""Megatron log-probs across TP/PP layouts and against HF transformers; training at TP2PP2.

One torchrun launch (4 gloo ranks) computes everything; the assertions run here.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_torchrun
from tests.helpers.mp_logprobs_worker import sequences

LAYOUTS = ["1x1", "2x1", "1x2", "2x2", "1x2v2"]
# 2x2 is DP=1; 2x1 is DP=2; 1x1 is DP=4 (4 ranks): the same global batch split differently.
TRAIN_LAYOUTS = ["2x2", "2x1", "1x1"]


@pytest.fixture(scope="module")
def results(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "results.json"
    run_torchrun(
        [
            "tests/helpers/mp_logprobs_worker.py",
            "--models",
            *map(str, tiny_models.values()),
            "--layouts",
            *LAYOUTS,
            "--train-layouts",
            *TRAIN_LAYOUTS,
            "--train-models",
            "llama_tied",
            "qwen3",
            "--out",
            str(out),
        ],
        nproc=4,
    )
    return json.loads(out.read_text())


def hf_logprobs(model_path) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq in sequences():
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits.float()[0, :-1], dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
    return out


@pytest.mark.parametrize("name", ["llama_tied", "llama_untied", "qwen2", "qwen3"])
def test_megatron_matches_hf(results, tiny_models, name):
    # The vocabulary (400) is padded to 512 rows in Megatron; had the 112 padded rows entered the
    # softmax, every log-prob would be off by about 0.25, far beyond the tolerance.
    ours = [torch.tensor(x) for x in results["logprobs"][f"{name}/1x1"]]
    for seq, mine, ref in zip(sequences(), ours, hf_logprobs(tiny_models[name])):
        assert mine.shape == (len(seq) - 1,)
        assert torch.allclose(mine, ref, atol=1e-4, rtol=0), (name, (mine - ref).abs().max())


@pytest.mark.parametrize("layout", ["2x1", "1x2", "2x2", "1x2v2"])
@pytest.mark.parametrize("name", ["llama_tied", "llama_untied", "qwen2", "qwen3"])
def test_layouts_match_tp1pp1(results, name, layout):
    base = results["logprobs"][f"{name}/1x1"]
    other = results["logprobs"][f"{name}/{layout}"]
    for a, b in zip(base, other):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0), (name, layout)


@pytest.mark.parametrize("name", ["llama_tied", "qwen3"])
def test_masked_nll_decreases_at_tp2pp2(results, name):
    losses = results["train"][f"{name}/2x2"]["losses"]
    assert len(losses) == 6
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("layout", ["2x1", "1x1"])
@pytest.mark.parametrize("name", ["llama_tied", "qwen3"])
def test_training_is_independent_of_data_parallel_split(results, name, layout):
    # Losses are normalised by the global token count and summed over micro-batches and DP
    # ranks: the loss and the gradient norm must be the same at DP=1, 2 and 4. A missing or
    # doubled 1/num_microbatches or 1/dp would change the gradient norm (Adam would hide it
    # in the losses of the first steps, not in the norm).
    base = results["train"][f"{name}/2x2"]
    other = results["train"][f"{name}/{layout}"]
    assert torch.allclose(torch.tensor(other["grad_norms"]), torch.tensor(base["grad_norms"]), rtol=1e-4), (
        base,
        other,
    )
    assert torch.allclose(torch.tensor(other["losses"]), torch.tensor(base["losses"]), rtol=1e-4), (
        base,
        other,
    )
