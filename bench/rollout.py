"""Agent-loop throughput against raw vLLM `generate` of the same number of tokens, same engine.

    .venv/bin/python bench/rollout.py [--num-prompts 64] [--turns 3] [--tokens-per-turn 128] [--model DIR]

The agent loop runs N prompts; in each of the first `turns - 1` turns the model is scripted to
emit a tool call of about `tokens-per-turn` ids (forced tokens: the engine still runs every
forward pass and samples under the restriction) to a tool that answers instantly; the last
turn samples freely for `tokens-per-turn` ids, stopping neither at EOS nor at a `</tool_call>`
sampled by chance, so that every trajectory samples the same count. The raw run then
generates, on the same engine, from the same prompt ids (tool schemas included), the same
number of sampled tokens per prompt in one `LLM.generate` call (one turn, EOS ignored, the same
scripted ids forced first so that the forced-token processor costs the same on both sides).
The run stops with an error unless every tool call succeeded. Both runs are timed after a
warm-up, in alternating pairs; the median ratio is kept. The last line is `throughput_ratio=X`
(agent-loop sampled tokens/s over raw tokens/s); the target is >= 0.9. With no --model, a tiny
random Qwen2 model is used.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path


def _call(i: int, width: int) -> str:
    return "<tool_call>" + json.dumps({"name": "echo", "arguments": {"text": "x" * width}}) + "</tool_call>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=128, help="sampled ids per turn")
    parser.add_argument("--model", default="")
    parser.add_argument("--repeats", type=int, default=7, help="paired timed repeats (median ratio kept)")
    args = parser.parse_args()

    from megatron_agent.data.tasks import Task
    from megatron_agent.envs.tools import Tool, ToolSet
    from megatron_agent.rollout.agent_loop import AgentLoop, AgentLoopConfig
    from megatron_agent.rollout.async_engine import AsyncEngine
    from megatron_agent.rollout.chat import ChatFormat
    from megatron_agent.rollout.engine import SamplingConfig, VLLMEngine
    from megatron_agent.rollout.scripted import FORCED_KEY, ForcedTokensLogitsProcessor

    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    model = args.model
    if not model:
        from megatron_agent.models.tiny import make_tiny_model

        model = str(make_tiny_model(work / "tiny", "qwen2", max_position_embeddings=4096))
    engine = VLLMEngine(model, logits_processors=[ForcedTokensLogitsProcessor], cache_dir=str(work))
    chat = ChatFormat(engine.tokenizer)

    class Echo(Tool):
        name = "echo"
        description = "echo"
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

        async def call(self, text):
            return "ok"

    # Pick the call width so that a scripted call is about tokens-per-turn ids.
    width = 1
    while len(chat.encode(_call(0, width + 1))) <= args.tokens_per_turn:
        width += 1
    scripts = [chat.encode(_call(i, width)) for i in range(args.turns - 1)]

    def hook(traj, turn):
        if turn < len(scripts):
            return {FORCED_KEY: scripts[turn]}
        return None

    messages = [{"role": "user", "content": "Use the echo tool, then answer."}]
    tasks = [
        Task(f"p{i}", messages + [{"role": "user", "content": f"id {i}"}], ["echo"], {})
        for i in range(args.num_prompts)
    ]
    config = AgentLoopConfig(
        max_new_tokens=args.tokens_per_turn, max_turns=args.turns, max_total_tokens=4096, temperature=1.0
    )
    aengine = AsyncEngine(engine)
    tools = ToolSet([Echo()])
    loop = AgentLoop(aengine, chat, tools, config, turn_hook=hook)
    # The last (free) turn must stop neither at EOS nor at a `</tool_call>` sampled by chance, so
    # that every trajectory samples the same count, as every raw prompt does: otherwise the last
    # turn runs a shrinking batch and the ratio measures that imbalance, not the loop.
    base_sampling = loop._sampling

    def sampling(max_tokens, traj, turn):
        s = base_sampling(max_tokens, traj, turn)
        if turn >= len(scripts):
            s.ignore_eos, s.stop, s.stop_token_ids = True, [], []
        return s

    loop._sampling = sampling

    def agent_run():
        start, cpu = time.perf_counter(), time.process_time()
        trajs = loop.run(tasks)
        return trajs, time.perf_counter() - start, time.process_time() - cpu

    def raw_run(num_tokens):
        prompts = [chat.prompt_ids(t.messages, tools.schemas(t.tools)) for t in tasks]  # as the loop's
        start, cpu = time.perf_counter(), time.process_time()
        # The same scripted calls are forced here too, so that the forced-token processor costs
        # the same on both sides and the ratio measures the agent loop alone.
        forced = {FORCED_KEY: [t for script in scripts for t in script]} if scripts else None
        sampling = SamplingConfig(max_tokens=num_tokens, temperature=1.0, ignore_eos=True, extra_args=forced)
        outs = engine.generate(prompts, sampling)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        return sum(len(o[0].token_ids) for o in outs), seconds, cpu

    agent_run()  # warm-up
    # Paired, alternating repeats (the machine may be shared): the median ratio is reported.
    ratios, cpu_ratios, runs = [], [], []
    # Every trajectory samples (turns - 1) scripted calls plus one free turn of tokens-per-turn ids.
    per_prompt = sum(len(script) for script in scripts) + args.tokens_per_turn
    for repeat in range(args.repeats):
        # The order alternates (agent first, then raw first) so that a drift of the machine's
        # speed during the run does not favour one side.
        for side in ("agent", "raw") if repeat % 2 == 0 else ("raw", "agent"):
            engine.reset_prefix_cache()
            if side == "agent":
                trajs, agent_s, agent_cpu = agent_run()
                sampled = sum(sum(t.loss_mask) for t in trajs)
            else:
                raw_tokens, raw_s, raw_cpu = raw_run(per_prompt)
        if sampled != raw_tokens:
            raise SystemExit(f"unequal work: the agent loop sampled {sampled} ids, raw {raw_tokens}")
        ratios.append((sampled / agent_s) / (raw_tokens / raw_s))
        cpu_ratios.append((sampled / agent_cpu) / (raw_tokens / raw_cpu))
        runs.append((ratios[-1], sampled, agent_s, raw_tokens, raw_s, trajs))
    aengine.close()
    ratio, sampled, agent_s, raw_tokens, raw_s, trajs = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    agent_tps, raw_tps = sampled / agent_s, raw_tokens / raw_s
    cpu_ratio = sorted(cpu_ratios)[len(cpu_ratios) // 2]
    num_turns = sum(t.num_turns for t in trajs) / len(trajs)
    statuses = Counter(c.status for t in trajs for c in t.tool_calls)
    if set(statuses) != {"ok"}:  # a benchmark of failing calls would time error messages
        raise SystemExit(f"tool calls did not all succeed: {dict(statuses)}")
    print(f"model={model} prompts={args.num_prompts} turns/traj={num_turns:.2f} cpu_threads={os.cpu_count()}")
    print(f"agent_loop: sampled_tokens={sampled} seconds={agent_s:.3f} tokens_per_s={agent_tps:.1f}")
    print(f"raw_generate: tokens={raw_tokens} seconds={raw_s:.3f} tokens_per_s={raw_tps:.1f}")
    print(f"tool calls: {dict(statuses)}")
    print(f"ratios of the repeats: {', '.join(f'{r:.3f}' for r in ratios)}")
    # Tokens per CPU-second of this process: steadier than wall time on a shared machine.
    print(f"cpu_ratios of the repeats: {', '.join(f'{r:.3f}' for r in cpu_ratios)} (median {cpu_ratio:.3f})")
    print(f"throughput_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
