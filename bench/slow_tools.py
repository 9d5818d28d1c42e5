"""A calculator with a heavy-tailed latency, for bench/async.py (loaded by dotted path in the
rollout workers: `tools.enabled=[bench.slow_tools.SlowCalculator]`).

Each call sleeps a log-normal time, median 20 ms and sigma 1.5 (about one call in 50 takes over
0.5 s, the slowest ones seconds): the long tail that agent rollouts meet with real tools.

`BENCH_TOOL_LATENCY_SEED` (an integer) seeds the delays: the n-th call of an engine's process then
sleeps the n-th draw of that seed, so runs compared side by side meet the same tail (common random
numbers: the ratio of two runs no longer depends on which of them drew a multi-second call).
Unset: an unseeded generator.
"""

from __future__ import annotations

import asyncio
import math
import os
import random

from megatron_agent.envs.tools.calculator import Calculator

MEDIAN_S, SIGMA = 0.020, 1.5


def _latency_rng() -> random.Random:
    """The delays' generator: seeded by `BENCH_TOOL_LATENCY_SEED` when it is set (not a run's
    state: only the benchmark sets it)."""
    seed = os.environ.get("BENCH_TOOL_LATENCY_SEED")
    if seed is None:
        return random.Random()
    try:
        return random.Random(int(seed))
    except ValueError:
        raise ValueError(f"BENCH_TOOL_LATENCY_SEED={seed!r} is not an integer") from None


_rng = _latency_rng()


class SlowCalculator(Calculator):
    """The calculator, answering after a log-normal delay."""

    async def call(self, expression: str) -> str:
        """The expression's value, late."""
        await asyncio.sleep(min(_rng.lognormvariate(math.log(MEDIAN_S), SIGMA), 5.0))
        return await super().call(expression)
