"""GPU only: vLLM sleep mode frees memory for the trainer, and generation resumes unchanged."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM")


def test_sleep_frees_memory_and_wake_up_restores_generation(tiny_models, tmp_path):
    from megatron_agent.rollout.engine import SamplingConfig, VLLMEngine

    engine = VLLMEngine(
        tiny_models["qwen2"], enable_sleep_mode=True, gpu_memory_utilization=0.3, cache_dir=str(tmp_path)
    )
    greedy = SamplingConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = [[1, 2, 3, 4, 5]]
    before = engine.generate(prompt, greedy)[0][0].token_ids
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep(level=1)  # weights offloaded to host memory, KV cache discarded
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake, "sleep() freed no GPU memory"
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompt, greedy)
    engine.wake_up()
    assert engine.generate(prompt, greedy)[0][0].token_ids == before
