"""GPU only: vLLM serves the FP8 checkpoint made from a BF16 model, and an FP8 weight update
(weights + per-tensor scales, the layout the sync sends) makes it compute with the new weights.

Reference: HF transformers in fp32 on the same weights. Two random tiny models A and B differ by
about 0.26 nats per token on average, FP8 weight quantization alone moves log-probs by about 0.01
(measured on CPU with dequantized weights): the engine must sit much closer to the model it was
given. Skipped without CUDA or vLLM.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM")


def _hf_logprobs(path, seqs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(ids).logits.float()[0, :-1], -1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


def _fp8_tensors(path, scales: str):
    from megatron_agent.quant.formats import FORMATS
    from megatron_agent.quant.hf_folder import iter_folder_tensors

    return list(iter_folder_tensors(path, FORMATS["fp8" if scales == "tensor" else "fp8_block128"]))


def test_fp8_engine_serves_and_reloads_fp8_weights(tiny_models, tmp_path):
    from megatron_agent.models.tiny import make_tiny_model
    from megatron_agent.rollout.engine import SamplingConfig, VLLMEngine
    from megatron_agent.sync.receiver import WeightReceiver
    from tests.helpers.mp_logprobs_worker import sequences

    model_a = tiny_models["qwen2"]
    model_b = make_tiny_model(tmp_path / "b", "qwen2", seed=7)
    seqs = sequences()
    ref_a, ref_b = _hf_logprobs(model_a, seqs), _hf_logprobs(model_b, seqs)
    engine = VLLMEngine(
        model_a,
        dtype="bfloat16",
        quantization="fp8",
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        cache_dir=str(tmp_path),
    )
    assert engine.quantization == {"quantization": "fp8", "format": "fp8"}
    receiver = WeightReceiver(engine)
    assert receiver.info()["quantization"] == engine.quantization  # what the sender quantizes for
    served_a = torch.tensor([x for row in receiver.probe(seqs) for x in row])
    assert (served_a - ref_a).abs().mean() < 0.5 * (served_a - ref_b).abs().mean()
    assert (served_a - ref_a).abs().max() < 1.0

    engine.update_weights(_fp8_tensors(model_b, "tensor"))
    served_b = torch.tensor([x for row in receiver.probe(seqs) for x in row])
    assert (served_b - ref_b).abs().mean() < 0.5 * (served_b - ref_a).abs().mean()
    assert (served_b - ref_b).abs().max() < 1.0
    out = engine.generate([[1, 2, 3]], SamplingConfig(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0][0].token_ids) == 8 and all(map(torch.isfinite, torch.tensor(out[0][0].logprobs)))
