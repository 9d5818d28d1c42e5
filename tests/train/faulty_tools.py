"""Misbehaving tools and a spread-out reward for the fault drills (loaded by dotted path in the
rollout workers, so `tests` must be importable there: the tests put the repository on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import sys
import time

from megatron_agent.envs.tools import Tool

FLOOD_BYTES = 4 << 20


class Crash(Tool):
    """Raises, as a tool with a bug does."""

    name = "crash"
    description = "c"

    async def call(self):
        raise RuntimeError("bad index")


class Exits(Tool):
    """Calls sys.exit, as an argparse-based CLI wrapper does on bad input."""

    name = "exits"
    description = "e"

    async def call(self):
        sys.exit(2)


class Hang(Tool):
    """A synchronous tool that sleeps far past its timeout."""

    name = "hang"
    description = "h"
    timeout_s = 0.5

    def call(self):
        time.sleep(3)
        return "too late"


class Flood(Tool):
    """Returns megabytes."""

    name = "flood"
    description = "f"

    async def call(self):
        return "x" * FLOOD_BYTES


class Jitter(Tool):
    """Sleeps a random 0-50 ms (from os.urandom, not a seeded RNG), so that tool calls return in
    an order that differs from run to run (the deterministic-mode drill)."""

    name = "jitter"
    description = "j"

    def call(self):
        time.sleep(os.urandom(1)[0] / 255 * 0.05)
        return "ok"


FAULTY = {"crash": Crash, "exits": Exits, "hang": Hang, "flood": Flood}
TOOL_PATHS = [f"tests.train.faulty_tools.{cls.__name__}" for cls in FAULTY.values()]


def calls_text(names: list[str]) -> str:
    """One assistant turn calling each tool of `names` once, then ending the turn."""
    calls = "".join("<tool_call>" + json.dumps({"name": n, "arguments": {}}) + "</tool_call>" for n in names)
    return calls + "<|im_end|>"


def spread_reward(response: str, ground_truth, trajectory) -> float:
    """A reward in [0, 1] that differs between trajectories (a function of the sampled ids), so
    that group advantages and hence the update are not zero for a random model."""
    ids = trajectory.response_ids[-16:]
    return (sum(ids) % 11) / 10.0
