"""One tiny model and ONE in-process vLLM engine per test session, shared by the rollout tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 model (fp32) with the local tokenizer and chat template."""
    from megatron_agent.models.tiny import make_tiny_model

    # Longer positions than the default 512: tool schemas in the system prompt take ~300 ids.
    return make_tiny_model(
        tmp_path_factory.mktemp("rollout_model") / "qwen2", "qwen2", seed=0, max_position_embeddings=4096
    )


@pytest.fixture(scope="session")
def engine(tiny_model_dir, tmp_path_factory):
    """The session's vLLM engine (fp32, eager, in-process), with the forced-token logits processor.
    vLLM's own cache stays where it is (`VLLM_CACHE_ROOT`, ~/.cache/vllm), as in a run: an empty
    one made vLLM inspect the model classes again in a subprocess (7 s of this fixture's 14 s)."""
    cache = tmp_path_factory.mktemp("engine_cache")  # the engine's `cache_dir`
    from megatron_agent.rollout.engine import VLLMEngine
    from megatron_agent.rollout.scripted import ForcedTokensLogitsProcessor

    eng = VLLMEngine(
        tiny_model_dir,
        dtype="float32",
        kv_cache_memory_bytes=128 * 1024 * 1024,
        seed=0,
        logits_processors=[ForcedTokensLogitsProcessor],
        cache_dir=str(cache),
    )
    yield eng


@pytest.fixture(scope="session")
def chat(engine):
    """The chat-template pieces of the tiny tokenizer."""
    from megatron_agent.rollout.chat import ChatFormat

    return ChatFormat(engine.tokenizer)
