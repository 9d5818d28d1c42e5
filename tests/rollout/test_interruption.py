"""A weight sync that interrupts requests in flight (asynchronous RL), on the real vLLM engine.

The `AsyncEngine` pump pauses itself after a fixed number of engine steps with one request in
flight; new weights go in (`update_weights(in_flight=True)`, as the receiver's `finish` does);
the pump resumes and the request continues under them. Checked against transformers in fp32:

- no token is lost or repeated: with the same weights the interrupted request equals the
  uninterrupted one token for token (the sampler's state survives the interruption);
- the version changes exactly at the interruption (`token_versions`);
- the tokens before it have the old weights' log-probs, those after it the new weights'
  (recomputed KV, the default); the engine's prefix cache holds no block of the old weights;
- with `keep_kv` the request keeps its old KV: its log-probs after the interruption are off
  (what the option costs), and the prefix cache is kept;
- the sync's probe (`prompt_logprobs`) runs while the request is in flight.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from megatron_agent.rollout.async_engine import AsyncEngine
from megatron_agent.rollout.engine import SamplingConfig
from tests.rollout.test_engine import _hf_logprobs

AT_STEP = 10  # engine steps before the interruption: one token each (the first with the prefill)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    """(original, perturbed) HF state dicts of the tiny model."""
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    return original, {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in original.items()}


@pytest.fixture
def restore(engine, weights):
    """The session's engine back to its weights, version and KV policy after the test."""
    version, keep_kv = engine.weight_version, engine.keep_kv
    yield
    engine.keep_kv = keep_kv
    engine.update_weights(iter(weights[0].items()))
    engine.weight_version = version


def _prompt(chat) -> list[int]:
    """A prompt longer than one KV block (32 ids), so that the prefix cache holds its blocks."""
    return chat.prompt_ids([{"role": "user", "content": "Count the foxes in the forest, slowly. " * 3}])


def _sampling() -> SamplingConfig:
    return SamplingConfig(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True, seed=11)


def _interrupted(engine, prompt, new_weights, probe=None):
    """Generate with a sync after AT_STEP engine steps; returns (output, cached blocks before and
    after the new weights went in, the probe's answer)."""
    pump = AsyncEngine(engine)

    async def main():
        pump.pause_after(AT_STEP)
        request = asyncio.ensure_future(pump.generate(prompt, _sampling()))
        while not pump.paused:
            await asyncio.sleep(0)
        before = engine.num_cached_blocks()
        engine.update_weights(iter(new_weights.items()), in_flight=True)
        after = engine.num_cached_blocks()
        probed = engine.prompt_logprobs([probe]) if probe else None
        pump.resume()
        return await request, before, after, probed

    try:
        return asyncio.run(main())
    finally:
        pump.close()


def test_an_interrupted_request_keeps_every_token_once_and_its_sampler(engine, chat, weights, restore):
    prompt = _prompt(chat)
    version = engine.weight_version
    whole = engine.generate([prompt], _sampling())[0][0]
    out, before, after, probed = _interrupted(engine, prompt, weights[0], probe=prompt)
    assert out.token_ids == whole.token_ids  # nothing lost, nothing repeated, same random draws
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(whole.logprobs), atol=1e-5, rtol=0)
    assert out.token_versions == [version] * AT_STEP + [version + 1] * (NEW_TOKENS - AT_STEP)
    assert before > 0 and after == 0  # the sync emptied the prefix cache
    # The probe ran while the request was in flight: log p(token i | tokens < i) of the prompt.
    expected = _hf_logprobs(engine.model_path, weights[0], prompt[:1], prompt[1:])
    torch.testing.assert_close(torch.tensor(probed[0]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("keep_kv", [False, True])
def test_tokens_after_the_interruption_are_the_new_weights(
    engine, chat, tiny_model_dir, weights, restore, keep_kv
):
    original, perturbed = weights
    engine.keep_kv = keep_kv
    prompt = _prompt(chat)
    out, before, after, _ = _interrupted(engine, prompt, perturbed)
    ids, got = out.token_ids, torch.tensor(out.logprobs)
    assert len(ids) == NEW_TOKENS and out.token_versions[AT_STEP - 1] + 1 == out.token_versions[AT_STEP]
    old = _hf_logprobs(tiny_model_dir, original, prompt, ids)
    new = _hf_logprobs(tiny_model_dir, perturbed, prompt, ids)
    torch.testing.assert_close(got[:AT_STEP], old[:AT_STEP], atol=1e-3, rtol=0)  # sampled before the sync
    diff_after = (got[AT_STEP:] - new[AT_STEP:]).abs().max().item()
    if keep_kv:
        # The KV of the prompt and the first tokens is the old weights': the new tokens' log-probs
        # are neither the new weights' (what the trainer computes) nor the old ones'.
        assert diff_after > 1e-2, diff_after
        assert after == before > 0  # the prefix cache kept its blocks
    else:
        assert diff_after < 1e-3, diff_after  # fp32: the trainer's log-probs at the new version
        assert after == 0
