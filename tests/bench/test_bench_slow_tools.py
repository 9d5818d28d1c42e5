"""bench/slow_tools.py: the slow calculator's delays, seeded by `BENCH_TOOL_LATENCY_SEED`, are the
same sequence in every process given that seed (bench/async.py's modes of one round meet the same
tail), another sequence under another seed, and it still answers as the calculator does."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO, fresh_python

PROBE = r"""
import asyncio, json
import bench.slow_tools as slow

delays = []
async def record(seconds):
    delays.append(seconds)
slow.asyncio.sleep = record  # asyncio's sleep in this probe process: recorded, not slept
tool = slow.SlowCalculator()
answers = [asyncio.run(tool.call(expression=f"{i} * 3")) for i in range(200)]
print(json.dumps({"delays": delays, "answers": answers}))
"""


def _draw(seed: str | None) -> dict:
    env = {"PYTHONPATH": "."} | ({"BENCH_TOOL_LATENCY_SEED": seed} if seed is not None else {})
    return fresh_python(PROBE, env=env)


def test_one_seed_gives_every_process_the_same_delays_and_another_seed_others():
    first, again, other = _draw("3"), _draw("3"), _draw("4")
    assert first["delays"] == again["delays"]
    assert first["delays"] != other["delays"]
    assert first["answers"] == [str(3 * i) for i in range(200)]
    delays = sorted(first["delays"])
    assert 0.005 < delays[100] < 0.08, delays[100]  # median about 20 ms
    assert delays[-1] > 0.3 and max(delays) <= 5.0  # a long tail, capped


def test_without_a_seed_the_delays_differ_between_processes():
    assert _draw(None)["delays"] != _draw(None)["delays"]


def test_a_seed_that_is_not_an_integer_is_named():
    proc = subprocess.run(
        [sys.executable, "-c", "import bench.slow_tools"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": ".", "BENCH_TOOL_LATENCY_SEED": "ten"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "BENCH_TOOL_LATENCY_SEED='ten' is not an integer" in proc.stderr
