"""GPU only: the Transformer Engine spec reproduces HF log-probs; FP8 runs. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine", reason="needs Transformer Engine (NGC image)")


@pytest.fixture(scope="module")
def parallel():
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    init_model_parallel(1, 1)
    yield
    destroy_model_parallel()


@pytest.mark.parametrize("name", ["llama_tied", "qwen2", "qwen3"])
def test_te_spec_matches_hf(parallel, tiny_models, name):
    from transformers import AutoModelForCausalLM

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions, resolve_transformer_impl
    from tests.helpers.mp_logprobs_worker import sequences

    assert resolve_transformer_impl("auto") == "te"
    model = policy_from_hf(tiny_models[name], BuildOptions(transformer_impl="te"), trainable=False)
    ours = model.logprobs(sequences())
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models[name]), dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for seq, mine in zip(sequences(), ours):
            ids = torch.tensor([seq], device="cuda")
            ref = torch.log_softmax(hf(ids).logits.float()[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            # TE kernels use TF32/fused paths: a looser bound than the CPU's 1e-4.
            assert torch.allclose(mine.cuda(), ref, atol=2e-3), (name, (mine.cuda() - ref).abs().max())


def test_fp8_forward_runs(parallel, tiny_models):
    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions
    from tests.helpers.mp_logprobs_worker import sequences

    model = policy_from_hf(
        tiny_models["qwen2"],
        BuildOptions(transformer_impl="te", dtype="bf16", fp8="tensorwise"),
        trainable=False,
    )
    for lp in model.logprobs(sequences()):
        assert torch.isfinite(lp).all()
