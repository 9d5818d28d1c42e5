"""Activation recomputation (`model.recompute`) and the build's errors for options this machine lacks."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_agent.models.build import BuildOptions, transformer_config
from megatron_agent.models.hf_config import arch_from_hf_config, load_hf_config
from tests.conftest import run_torchrun


@pytest.fixture(scope="module")
def results(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("recompute") / "results.json"
    run_torchrun(
        ["tests/models/recompute_worker.py", "--model", str(tiny_models["qwen3"]), "--out", str(out)], nproc=2
    )
    return json.loads(out.read_text())


def test_recompute_reaches_the_transformer_config(results):
    assert [results[r]["granularity"] for r in ("none", "selective", "full")] == [None, "selective", "full"]


def test_recomputed_modules_run_again_in_backward(results):
    # Without recompute each module runs once per micro-batch forward; a recomputed one runs
    # again in the backward pass (selective: core attention only; full: the whole layer).
    n = results["none"]["forwards"]
    assert results["none"]["calls"] == {"core_attention": n, "layer": n}
    assert results["selective"]["calls"] == {"core_attention": 2 * n, "layer": n}
    assert results["full"]["calls"]["layer"] == 2 * n


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_training(results, recompute):
    base, other = results["none"], results[recompute]
    assert torch.allclose(torch.tensor(other["losses"]), torch.tensor(base["losses"]), rtol=1e-6, atol=0)
    assert torch.allclose(
        torch.tensor(other["grad_norms"]), torch.tensor(base["grad_norms"]), rtol=1e-5, atol=0
    )
    assert base["losses"][1] < base["losses"][0]


@pytest.fixture
def arch(tiny_models):
    return arch_from_hf_config(load_hf_config(tiny_models["qwen2"]))


def test_bad_recompute_and_sequence_parallel_without_tp_are_errors(arch):
    with pytest.raises(
        ValueError, match=r"model.recompute='partial': choose one of \('none', 'selective', 'full'\)"
    ):
        transformer_config(arch, BuildOptions(recompute="partial"))
    with pytest.raises(
        ValueError, match="sequence_parallel=true needs tensor parallelism: set parallel.tp > 1"
    ):
        transformer_config(arch, BuildOptions(sequence_parallel=True))


def test_sequence_parallel_reaches_the_transformer_config(arch):
    config, _ = transformer_config(arch, BuildOptions(tp=2, sequence_parallel=True))
    assert config.sequence_parallel and config.tensor_model_parallel_size == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only errors")
@pytest.mark.parametrize(
    "opts, message",
    [
        (BuildOptions(fp8="delayed"), "model.fp8 needs Transformer Engine on a GPU"),
        (BuildOptions(fp8="mxfp8", recompute="full"), "model.fp8 needs Transformer Engine on a GPU"),
        (BuildOptions(transformer_impl="te"), "transformer_impl=te needs Transformer Engine and a CUDA GPU"),
    ],
)
def test_gpu_only_options_are_clear_errors_on_cpu(arch, opts, message):
    with pytest.raises(ValueError, match=message):
        transformer_config(arch, opts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only choice")
def test_capability_check_picks_the_local_spec_on_cpu(arch):
    _, impl = transformer_config(arch, BuildOptions())
    assert impl == "local"
