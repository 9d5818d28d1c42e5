"""The agent loop on real vLLM outputs: token provenance, the seed case, bad behaviour as data.

Scripted trajectories use `ForcedTokensLogitsProcessor`: the engine is restricted to the
script's ids, but every id and log-prob still comes out of vLLM (raw log-probs of the model).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_agent.data.tasks import Task
from megatron_agent.envs.tools import Calculator, Tool, ToolSet
from megatron_agent.rollout.agent_loop import AgentLoop, AgentLoopConfig, truncate_ids
from megatron_agent.rollout.async_engine import AsyncEngine
from megatron_agent.rollout.engine import SamplingConfig
from megatron_agent.rollout.metrics import rollout_metrics
from megatron_agent.rollout.scripted import FORCED_KEY
from megatron_agent.rollout.trajectory import TokenSource, build_training_batch

S, INJ, TOOL, TPL = TokenSource.SAMPLED, TokenSource.INJECTED, TokenSource.TOOL, TokenSource.TEMPLATE


def call(name, args):
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class Echo(Tool):
    name = "echo"
    description = "echo"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    async def call(self, text):
        return text


class Raises(Tool):
    name = "raises"
    description = "fails"

    async def call(self):
        raise KeyError("boom")


class Hangs(Tool):
    name = "hangs"
    description = "never returns"
    timeout_s = 0.3

    async def call(self):
        await asyncio.sleep(60)


class BlocksThread(Tool):
    name = "blocks"
    description = "a synchronous tool that blocks"
    timeout_s = 0.3

    def call(self):
        time.sleep(10)  # far past its timeout: the run must not wait for it
        return "late"


class Huge(Tool):
    name = "huge"
    description = "megabytes"

    async def call(self):
        return "0123456789" * 300_000


class BadBytes(Tool):
    name = "badbytes"
    description = "invalid utf-8"

    async def call(self):
        return b"ok \xff\xfe\xfd end"


TOOLS = [Calculator(), Echo(), Raises(), Hangs(), BlocksThread(), Huge(), BadBytes()]


def task(uid, tools, content="What is 1 + 2?", reward=None):
    return Task(
        uid, [{"role": "user", "content": content}], tools, reward or {"fn": "numeric", "ground_truth": "3"}
    )


def scripted_loop(engine, chat, scripts, **cfg):
    """An AgentLoop whose turn k of task uid is forced to scripts[uid][k] (text)."""

    def hook(traj, turn):
        script = scripts.get(traj.task_uid, [])
        if turn < len(script):
            return {FORCED_KEY: chat.encode(script[turn])}
        return None

    config = AgentLoopConfig(**{"max_new_tokens": 80, "max_total_tokens": 2048, "temperature": 1.0, **cfg})
    aengine = AsyncEngine(engine, record=True)
    return AgentLoop(aengine, chat, ToolSet(TOOLS, timeout_s=2.0), config, turn_hook=hook)


def check_provenance(traj, loop):
    """Every invariant of the provenance contract, against what the engine really saw."""
    chat = loop.chat
    sampled = [False] * len(traj.response_ids)
    for start, end in traj.turn_spans:
        # Some engine request consumed exactly the ids before this turn and produced exactly its
        # ids, with these log-probs bit for bit (prompts may repeat across trajectories).
        consumed = traj.prompt_ids + traj.response_ids[:start]
        produced = (traj.response_ids[start:end], traj.rollout_logprobs[start:end])
        matches = [c for c in loop.engine.calls if c.prompt_ids == consumed]
        assert matches, "no engine request consumed these ids"
        assert produced in [(c.output.token_ids, c.output.logprobs) for c in matches]
        for i in range(start, end):
            sampled[i] = True
    assert [s is S for s in traj.token_source] == sampled
    assert traj.loss_mask == [int(x) for x in sampled]
    for source, logp in zip(traj.token_source, traj.rollout_logprobs):
        assert (logp is not None) == (source is S)
    for (_, end), (nxt, _) in zip(traj.turn_spans, traj.turn_spans[1:]):
        gap = traj.response_ids[end:nxt]
        gap_src = traj.token_source[end:nxt]
        if traj.response_ids[end - 1] == chat.eos_id:
            assert gap_src[0] is TPL  # the engine closed its own turn: nothing injected
        else:
            assert gap[0] == chat.eos_id and gap_src[0] is INJ  # closed by us: injected, no loss
            assert gap_src.count(INJ) == 1
        assert gap_src[-1] is TPL
    build_training_batch([traj])


def segments(traj, start, end):
    """[(source, ids)] runs of equal source in response_ids[start:end]."""
    runs = []
    for tok, src in zip(traj.response_ids[start:end], traj.token_source[start:end]):
        if runs and runs[-1][0] is src:
            runs[-1][1].append(tok)
        else:
            runs.append((src, [tok]))
    return runs


def test_scripted_multi_turn_provenance(engine, chat):
    scripts = {
        "calc": [
            call("calculator", {"expression": "1 + 2"}),
            call("echo", {"text": "three"}),
            "<answer>3</answer><|im_end|>",
        ],
    }
    loop = scripted_loop(engine, chat, scripts)
    (traj,) = loop.run([task("calc", ["calculator", "echo"])])
    assert traj.finish_reason == "stop" and traj.num_turns == 3 and len(traj.turn_spans) == 3
    assert [c.status for c in traj.tool_calls] == ["ok", "ok"]
    assert traj.reward == 1.0
    check_provenance(traj, loop)
    # The seed case: turn 0 stopped at </tool_call> (a sampled token); the closing <|im_end|>
    # that follows is injected, not sampled, and carries no loss.
    end0 = traj.turn_spans[0][1]
    assert traj.response_ids[end0 - 1] == chat.tool_call_end_id and traj.token_source[end0 - 1] is S
    assert traj.response_ids[end0] == chat.eos_id and traj.token_source[end0] is INJ
    assert traj.loss_mask[end0] == 0 and traj.rollout_logprobs[end0] is None
    # Between turns: injected EOS, template, tool output "3", template ending in the generation prompt.
    runs = segments(traj, end0, traj.turn_spans[1][0])
    parts = chat.tool_turn(1).parts
    assert runs == [
        (INJ, [chat.eos_id]),
        (TPL, parts[0]),
        (TOOL, chat.encode("3", plain=True)),
        (TPL, parts[1]),
    ]
    assert chat.decode(parts[1]).endswith("<|im_start|>assistant\n")
    runs = segments(traj, traj.turn_spans[1][1], traj.turn_spans[2][0])
    assert chat.decode(runs[2][1]) == "three"
    # The final turn ended with an EOS the engine sampled itself.
    assert traj.response_ids[-1] == chat.eos_id and traj.token_source[-1] is S


def test_several_calls_in_one_turn_when_not_stopping_at_the_call(engine, chat):
    turn0 = call("calculator", {"expression": "2 * 3"}) + call("echo", {"text": "x"}) + "<|im_end|>"
    loop = scripted_loop(
        engine, chat, {"two": [turn0, "<answer>6</answer><|im_end|>"]}, stop_at_tool_call=False
    )
    (traj,) = loop.run([task("two", ["calculator", "echo"])])
    assert [(c.name, c.status) for c in traj.tool_calls] == [("calculator", "ok"), ("echo", "ok")]
    assert traj.num_tokens(INJ) == 0  # the engine sampled the EOS itself
    end0 = traj.turn_spans[0][1]
    assert traj.response_ids[end0 - 1] == chat.eos_id and traj.token_source[end0 - 1] is S
    parts = chat.tool_turn(2).parts
    runs = segments(traj, end0, traj.turn_spans[1][0])
    assert runs == [
        (TPL, parts[0]),
        (TOOL, chat.encode("6")),
        (TPL, parts[1]),
        (TOOL, chat.encode("x")),
        (TPL, parts[2]),
    ]
    check_provenance(traj, loop)


def test_bad_behaviour_is_data_and_the_run_goes_on(engine, chat):
    answer = "<answer>3</answer><|im_end|>"
    cases = {
        "malformed": (
            '<tool_call>{"name": "calculator", "arguments": {</tool_call>',
            ["calculator"],
            "malformed",
            "malformed tool call",
        ),
        "unknown": (call("nope", {}), ["calculator"], "unknown_tool", "unknown tool 'nope'"),
        "badargs": (
            call("calculator", {"expr": "1"}),
            ["calculator"],
            "bad_arguments",
            "missing required argument 'expression'",
        ),
        "raises": (call("raises", {}), ["raises"], "error", "raises failed: 'boom'"),
        "hangs": (call("hangs", {}), ["hangs"], "timeout", "hangs timed out after 0.3 s"),
        "blocks": (call("blocks", {}), ["blocks"], "timeout", "blocks timed out"),
        "huge": (call("huge", {}), ["huge"], "truncated", "0123456789"),
        "badbytes": (call("badbytes", {}), ["badbytes"], "invalid_utf8", "invalid UTF-8"),
        "divzero": (call("calculator", {"expression": "1/0"}), ["calculator"], "error", "division by zero"),
    }
    scripts = {uid: [script, answer] for uid, (script, *_rest) in cases.items()}
    loop = scripted_loop(engine, chat, scripts, max_tool_response_tokens=128)
    tasks = [task(uid, tools) for uid, (_, tools, _, _) in cases.items()]
    start = time.monotonic()
    trajs = loop.run(tasks)
    assert time.monotonic() - start < 9  # neither the hanging nor the blocking tool held it up
    for traj, (uid, (_, _, status, message)) in zip(trajs, cases.items()):
        assert traj.task_uid == uid
        assert [c.status for c in traj.tool_calls] == [status], uid
        assert traj.finish_reason == "stop" and traj.num_turns == 2, uid  # it went on to answer
        tool_ids = [t for t, s in zip(traj.response_ids, traj.token_source) if s is TOOL]
        assert message in chat.decode(tool_ids), (uid, chat.decode(tool_ids))
        assert len(tool_ids) <= 128
        check_provenance(traj, loop)
    metrics = rollout_metrics(trajs)
    assert metrics["tool/calls"] == 9
    assert metrics["tool/errors"] == 8 and metrics["tool/timeouts"] == 2 and metrics["tool/truncated"] == 1


def test_budgets_end_trajectories(engine, chat):
    loop = scripted_loop(
        engine,
        chat,
        {uid: [call("calculator", {"expression": "1+1"})] * 5 for uid in ("turns", "tokens", "len")},
        max_turns=2,
    )
    loop_len = scripted_loop(engine, chat, {}, max_new_tokens=3, max_turns=2)
    (turns,) = loop.run([task("turns", ["calculator"])])
    assert turns.finish_reason == "max_turns" and turns.num_turns == 2
    assert [c.status for c in turns.tool_calls] == ["ok", "not_run"]
    prompt_len = len(
        chat.prompt_ids(
            [{"role": "user", "content": "What is 1 + 2?"}], ToolSet(TOOLS).schemas(["calculator"])
        )
    )
    loop.config.max_total_tokens = prompt_len + 45
    (tokens,) = loop.run([task("tokens", ["calculator"])])
    assert tokens.finish_reason == "max_tokens" and len(tokens.all_ids) <= prompt_len + 45
    (length,) = loop_len.run([task("len", [], content="hi")])
    if length.finish_reason == "length":
        assert len(length.response_ids) == 3
    loop.config.max_trajectory_seconds = 1e-6
    (late,) = loop.run([task("turns", ["calculator"])])
    assert late.finish_reason == "timeout" and late.num_turns == 0
    for traj in (turns, tokens, length):
        check_provenance(traj, loop if traj is not length else loop_len)


def test_free_sampling_many_in_flight(engine, chat):
    """Unscripted sampling, 24 trajectories at once: every invariant holds on real outputs."""
    scripts = {f"t{i}": [call("calculator", {"expression": f"{i} * 2"})] for i in range(0, 12, 3)}
    loop = scripted_loop(engine, chat, scripts, max_new_tokens=48, max_turns=3)
    tasks = [task(f"t{i}", ["calculator"]) for i in range(12)]
    trajs = loop.run(tasks, n_samples=2)
    assert [t.uid for t in trajs] == [f"t{i}/{j}" for i in range(12) for j in range(2)]
    assert len({tuple(t.response_ids) for t in trajs}) > 12  # really sampled
    for traj in trajs:
        check_provenance(traj, loop)
    assert sum(t.num_tokens(INJ) for t in trajs) >= 8  # each scripted call was closed by an injected EOS
    batch = build_training_batch(trajs)
    assert int(batch["loss_mask_BT"].sum()) == sum(t.num_tokens(S) for t in trajs)


@pytest.mark.parametrize(
    "side,expected",
    [("right", [0, 1, 2, 3, 4]), ("left", [5, 6, 7, 8, 9]), ("middle", [0, 1, -1, 8, 9])],
)
def test_truncate_ids(side, expected):
    out, cut = truncate_ids(list(range(10)), 5, side, [-1])
    assert cut and out == expected
    assert truncate_ids([1, 2], 5, side, [-1]) == ([1, 2], False)


def test_weight_version_is_recorded_across_an_update(engine, chat, tiny_model_dir):
    from safetensors.torch import load_file

    loop = scripted_loop(engine, chat, {}, max_new_tokens=4, max_turns=1)
    (before,) = loop.run([task("v", [], content="hi")])
    version = loop.engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")).items())
    (after,) = loop.run([task("v", [], content="hi")])
    assert before.weight_version == version - 1 and after.weight_version == version


def test_the_pump_says_busy_while_it_steps(engine):
    """`async.share_cores`: the engine's activity byte (platform/core_sharing.py) is 1 while the
    pump takes steps, 0 once it waits."""
    from megatron_agent.platform.core_sharing import ActivityWatch, EngineActivity

    activity = EngineActivity("n")
    watch = ActivityWatch([activity.handle()], node="n")
    pump = AsyncEngine(engine)
    pump.activity = activity
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(watch.any_busy())
            time.sleep(0.001)

    async def generate():
        sampling = SamplingConfig(max_tokens=32, temperature=1.0, ignore_eos=True)
        await asyncio.gather(*(pump.generate([5, 6, 7, 8 + k], sampling) for k in range(4)))
        await asyncio.sleep(0.05)  # the pump goes back to waiting

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        asyncio.run(generate())
        assert not watch.any_busy()
    finally:
        done.set()
        sampler.join()
        pump.close()
    assert any(samples) and not samples[-1]
    activity.close()
