"""A calculator with a heavy-tailed latency, for bench/async.py (loaded by dotted path in the
rollout workers: `tools.enabled=[bench.slow_tools.SlowCalculator]`).

Each call sleeps a log-normal time, median 20 ms and sigma 1.5 (about one call in 50 takes over
0.5 s, the slowest ones seconds): the long tail that agent rollouts meet with real tools.
"""

from __future__ import annotations

import asyncio
import math
import random

from megatron_agent.envs.tools.calculator import Calculator

MEDIAN_S, SIGMA = 0.020, 1.5
_rng = random.Random()  # unseeded: tool latency is not part of a run's reproducible state


class SlowCalculator(Calculator):
    """The calculator, answering after a log-normal delay."""

    async def call(self, expression: str) -> str:
        """The expression's value, late."""
        await asyncio.sleep(min(_rng.lognormvariate(math.log(MEDIAN_S), SIGMA), 5.0))
        return await super().call(expression)
