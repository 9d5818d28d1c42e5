"""The multi-turn agent loop: generate, parse tool calls, run tools, append the tool turn as ids.

Per turn: generate until EOS, the end of a tool call or the turn's token limit; parse every
`<tool_call>` of the turn; run the tools concurrently with a timeout; append the tool-response
turn rendered by the model's own chat template, as token ids; repeat until the model answers
without a call or the turn, token or time budget ends. Provenance of the appended ids:

    sampled  : what the engine generated (with its log-prob), including EOS if it produced it
    injected : the EOS that closes a turn the engine stopped at `</tool_call>` (it was not sampled)
    template : chat-template ids around the tool outputs and the next generation prompt
    tool     : tool output (or the error message standing in for it), truncated to a token budget

Nothing is ever decoded and re-encoded: each turn's prompt is the previous prompt's ids plus the
ids appended here, exactly what the trainer will see. Misbehaviour of the model or of a tool
(malformed JSON, an unknown tool, bad arguments, an exception, a timeout, huge or invalid UTF-8
output) becomes an error message in the tool turn and a status on the call, never a crash.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from megatron_agent.data.tasks import Task
from megatron_agent.envs.rewards import compute_reward
from megatron_agent.envs.tools.base import ToolResult, ToolSet
from megatron_agent.rollout.async_engine import AsyncEngine
from megatron_agent.rollout.chat import ChatFormat
from megatron_agent.rollout.engine import SamplingConfig
from megatron_agent.rollout.tool_parser import ParsedCall, parse_tool_calls
from megatron_agent.rollout.trajectory import TokenSource, ToolCallRecord, Trajectory

logger = logging.getLogger(__name__)

TRUNCATE_SIDES = ("left", "middle", "right")


TurnHook = Callable[[Trajectory, int], "dict | None"]
"""`hook(trajectory, turn) -> extra_args or None` for the turn's request (scripted policies)."""


@dataclass
class AgentLoopConfig:
    """Budgets and sampling of the agent loop (built from RolloutConfig + ToolsConfig)."""

    max_new_tokens: int = 64
    """Tokens per assistant turn at most."""
    max_turns: int = 4
    """Assistant turns per trajectory at most."""
    max_total_tokens: int = 512
    """Prompt plus response ids at most."""
    max_trajectory_seconds: float = 0.0
    """Wall-clock budget of one trajectory (0: none)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus threshold."""
    top_k: int = -1
    """Top-k (-1: off)."""
    stop_at_tool_call: bool = True
    """End a turn at the first `</tool_call>` (else only at EOS, allowing several calls per turn)."""
    max_tool_response_tokens: int = 256
    """Tool output ids kept per call."""
    truncate_side: str = "middle"
    """Which part of a long tool output is dropped: left, middle or right."""
    max_in_flight: int = 256
    """Trajectories generating or running tools at once."""
    seed: int | None = None
    """Per-request sampling seeds (`request_seed(seed, uid, turn)`); None: the engine's own RNG."""
    lockstep: bool = False
    """Deterministic schedule: the engine steps only when every live trajectory waits on it, and
    admits requests in (uid, turn) order, so batches never depend on tool timing."""

    def __post_init__(self):
        if self.truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"truncate_side={self.truncate_side!r}: choose one of {TRUNCATE_SIDES}")
        if self.max_new_tokens < 1 or self.max_turns < 1 or self.max_total_tokens < 2:
            raise ValueError("max_new_tokens and max_turns must be >= 1 and max_total_tokens >= 2")


def request_seed(seed: int, uid: str, turn: int) -> int:
    """A stable 31-bit sampling seed of one request (trajectory `uid`, `turn`) under `seed`."""
    return zlib.crc32(f"{seed}:{uid}:{turn}".encode()) & 0x7FFFFFFF


def truncate_ids(ids: list[int], max_tokens: int, side: str, marker: list[int]) -> tuple[list[int], bool]:
    """`ids` cut to at most `max_tokens` by dropping the `side` part; `marker` marks a middle cut."""
    if len(ids) <= max_tokens:
        return ids, False
    if side == "right":
        return ids[:max_tokens], True
    if side == "left":
        return ids[len(ids) - max_tokens :], True
    keep = max(max_tokens - len(marker), 0)
    head, tail = (keep + 1) // 2, keep // 2
    return ids[:head] + marker[: max_tokens - keep] + (ids[len(ids) - tail :] if tail else []), True


class AgentLoop:
    """Runs tasks to trajectories on an `AsyncEngine` with a `ToolSet`."""

    def __init__(
        self,
        engine: AsyncEngine,
        chat: ChatFormat,
        tools: ToolSet,
        config: AgentLoopConfig,
        turn_hook: TurnHook | None = None,
    ):
        """`turn_hook` may return extra sampling args per turn (e.g. a forced token script)."""
        self.engine = engine
        self.chat = chat
        self.tools = tools
        self.config = config
        self.turn_hook = turn_hook
        self._marker = chat.encode("\n...[truncated]...\n", plain=True)

    # --------------------------------------------------------------------------------- public
    def run(self, tasks: list[Task], n_samples: int = 1) -> list[Trajectory]:
        """Synchronous wrapper of `run_async` (starts an event loop)."""
        return asyncio.run(self.run_async(tasks, n_samples))

    async def run_async(
        self, tasks: list[Task], n_samples: int = 1, config: AgentLoopConfig | None = None
    ) -> list[Trajectory]:
        """`n_samples` trajectories per task, all in flight together; ordered task-major.
        `config` replaces the loop's own for this call (several calls may run at once)."""
        if config is not None and config is not self.config:
            view = copy.copy(self)
            view.config = config
            return await view.run_async(tasks, n_samples)
        gate = asyncio.Semaphore(self.config.max_in_flight)

        async def one(task: Task, index: int) -> Trajectory:
            async with gate:
                if not self.config.lockstep:
                    return await self.run_trajectory(task, index)
                with self.engine.live_trajectory():
                    return await self.run_trajectory(task, index)

        return list(await asyncio.gather(*(one(t, i) for t in tasks for i in range(n_samples))))

    async def run_trajectory(self, task: Task, sample_index: int = 0) -> Trajectory:
        """Roll out one trajectory for `task` and score it."""
        cfg = self.config
        traj = Trajectory(
            uid=f"{task.uid}/{sample_index}",
            prompt_ids=self.chat.prompt_ids(task.messages, self.tools.schemas(task.tools)),
            task_uid=task.uid,
            sample_index=sample_index,
            weight_version=self.engine.weight_version,
        )
        deadline = time.monotonic() + cfg.max_trajectory_seconds if cfg.max_trajectory_seconds > 0 else None
        versions: list[int] = []
        for turn in range(cfg.max_turns):
            budget = cfg.max_total_tokens - len(traj.prompt_ids) - len(traj.response_ids)
            if budget <= 0:
                traj.finish_reason = "max_tokens"
                break
            sampling = self._sampling(min(cfg.max_new_tokens, budget), traj, turn)
            try:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                request = self.engine.generate(traj.all_ids, sampling, order_key=(traj.uid, turn))
                out = await asyncio.wait_for(request, remaining)
            except TimeoutError:
                traj.finish_reason = "timeout"
                break
            start = len(traj.response_ids)
            turn_versions = out.token_versions or [out.weight_version] * len(out.token_ids)
            traj.append(out.token_ids, TokenSource.SAMPLED, out.logprobs, version=turn_versions)
            traj.turn_spans.append((start, len(traj.response_ids)))
            traj.num_turns += 1
            versions.append(turn_versions[0] if turn_versions else out.weight_version)  # the turn's oldest
            if out.finish_reason == "length":
                traj.finish_reason = "length"
                break
            calls = parse_tool_calls(
                self.chat.decode(out.token_ids), self.chat.tool_call_start, self.chat.tool_call_end
            )
            if not calls:
                traj.finish_reason = "stop"
                break
            if turn + 1 >= cfg.max_turns:
                traj.tool_calls += [ToolCallRecord(c.name, c.arguments, "not_run", turn) for c in calls]
                traj.finish_reason = "max_turns"
                break
            ended_by_eos = bool(out.token_ids) and out.token_ids[-1] == self.chat.eos_id
            results = await asyncio.gather(*(self._run_call(c, task) for c in calls))
            if not self._append_tool_turn(traj, calls, results, ended_by_eos, turn):
                traj.finish_reason = "max_tokens"
                break
        else:
            traj.finish_reason = "max_turns"
        if versions:
            traj.weight_version = min(versions)
        self._score(task, traj)
        return traj

    # --------------------------------------------------------------------------------- pieces
    def _sampling(self, max_tokens: int, traj: Trajectory, turn: int) -> SamplingConfig:
        cfg = self.config
        stop_ids, stop = [], []
        if cfg.stop_at_tool_call:
            if self.chat.tool_call_end_id is not None:
                stop_ids = [self.chat.tool_call_end_id]
            else:
                stop = [self.chat.tool_call_end]
        extra = self.turn_hook(traj, turn) if self.turn_hook else None
        return SamplingConfig(
            n=1,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=stop_ids,
            seed=None if cfg.seed is None else request_seed(cfg.seed, traj.uid, turn),
            extra_args=extra,
        )

    async def _run_call(self, call: ParsedCall, task: Task) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"Error: malformed tool call ({call.error}).", "malformed")
        return await self.tools.run(call.name, call.arguments, allowed=task.tools)

    def _tool_output_ids(self, text: str) -> tuple[list[int], bool]:
        cfg = self.config
        limit = cfg.max_tool_response_tokens
        # Cut megabytes by characters first so that tokenizing stays cheap; every token covers at
        # least one character, so 8 characters per kept token cannot shorten below the budget.
        max_chars = max(limit * 8, 64)
        cut_chars = len(text) > max_chars
        if cut_chars:
            if cfg.truncate_side == "right":
                text = text[:max_chars]
            elif cfg.truncate_side == "left":
                text = text[-max_chars:]
            else:
                text = text[: max_chars // 2] + text[-max_chars // 2 :]
        ids, cut = truncate_ids(self.chat.encode(text, plain=True), limit, cfg.truncate_side, self._marker)
        return ids, cut or cut_chars

    def _append_tool_turn(self, traj, calls, results, ended_by_eos: bool, turn: int) -> bool:
        """Append closing EOS (injected if not sampled), the tool turn and the generation prompt.

        Returns False (appending only the closing token) when the tool turn would overflow
        `max_total_tokens`; the trajectory then ends.
        """
        closing = [] if ended_by_eos else list(self.chat.closing_ids)
        pieces = self.chat.tool_turn(len(results)).parts
        outputs = []
        for call, result in zip(calls, results):
            ids, cut = self._tool_output_ids(result.text)
            status = "truncated" if cut and result.status == "ok" else result.status
            traj.tool_calls.append(ToolCallRecord(call.name, call.arguments, status, turn, result.seconds))
            outputs.append(ids)
        new = len(closing) + sum(len(p) for p in pieces) + sum(len(o) for o in outputs)
        room = self.config.max_total_tokens - len(traj.prompt_ids) - len(traj.response_ids)
        if new >= room:
            if closing and len(closing) <= room:
                traj.append(closing, TokenSource.INJECTED)
            return False
        traj.append(closing, TokenSource.INJECTED)
        for piece, ids in zip(pieces, outputs):
            traj.append(piece, TokenSource.TEMPLATE)
            traj.append(ids, TokenSource.TOOL)
        traj.append(pieces[-1], TokenSource.TEMPLATE)
        return True

    def _score(self, task: Task, traj: Trajectory) -> None:
        if not task.reward:
            return
        if traj.turn_spans:
            start, end = traj.turn_spans[-1]
            answer = self.chat.decode(traj.response_ids[start:end])
        else:
            answer = ""
        try:
            traj.reward, traj.reward_info = compute_reward(task.reward, answer, traj)
        except Exception as exc:  # noqa: BLE001 - a broken reward function must not stop the run
            logger.warning("reward of %s failed: %s", traj.uid, exc)
            traj.reward, traj.reward_info = 0.0, {"error": str(exc)}
