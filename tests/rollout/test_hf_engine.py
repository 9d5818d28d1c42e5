"""The `hf` debugging engine agrees with vLLM and drives the agent loop through the same interface."""

from __future__ import annotations

import torch

from megatron_agent.data.tasks import Task
from megatron_agent.envs.tools import Calculator, ToolSet
from megatron_agent.rollout.agent_loop import AgentLoop, AgentLoopConfig
from megatron_agent.rollout.async_engine import AsyncEngine
from megatron_agent.rollout.engine import SamplingConfig
from megatron_agent.rollout.hf_engine import HFEngine
from megatron_agent.rollout.scripted import FORCED_KEY


def test_hf_engine_matches_vllm_and_runs_the_loop(engine, chat, tiny_model_dir):
    hf = HFEngine(tiny_model_dir, seed=0)
    prompt = chat.prompt_ids([{"role": "user", "content": "What is 12 + 7?"}])
    out = hf.generate([prompt], SamplingConfig(max_tokens=10, temperature=1.0, top_k=20, ignore_eos=True))[0][
        0
    ]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    forced = SamplingConfig(max_tokens=10, ignore_eos=True, extra_args={FORCED_KEY: out.token_ids})
    ref = engine.generate([prompt], forced)[0][0]
    assert ref.token_ids == out.token_ids
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    loop = AgentLoop(
        AsyncEngine(hf),
        chat,
        ToolSet([Calculator()]),
        AgentLoopConfig(max_new_tokens=8, max_turns=2, max_total_tokens=2048),
    )
    task = Task("t", [{"role": "user", "content": "hi"}], [], {"fn": "numeric", "ground_truth": "1"})
    trajs = loop.run([task], n_samples=2)
    assert len(trajs) == 2 and all(
        t.num_turns >= 1 and len(t.rollout_logprobs) == len(t.response_ids) for t in trajs
    )
    before = hf.weight_version
    hf.update_weights([("model.norm.weight", torch.ones(128))])
    assert hf.weight_version == before + 1
