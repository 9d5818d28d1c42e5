"""The rollout benchmark measures what it says: equal work on both sides, every tool call ok.

A small run (4 prompts, 2 turns of 48 ids, one repeat) of `bench/rollout.py`; the ratio itself
is not asserted (timing belongs to the benchmark), only that the run completed its checks.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rollout_benchmark_runs_equal_work_with_successful_calls(tmp_path):
    cmd = [sys.executable, "bench/rollout.py", "--num-prompts", "4", "--turns", "2"]
    cmd += ["--tokens-per-turn", "48", "--repeats", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "tool calls: {'ok': 4}" in out, out
    agent = int(re.search(r"agent_loop: sampled_tokens=(\d+)", out).group(1))
    raw = int(re.search(r"raw_generate: tokens=(\d+)", out).group(1))
    # 4 trajectories: a scripted call (at most 48 ids) plus a free turn of exactly 48 ids each.
    assert agent == raw and 4 * 49 <= agent <= 4 * 96, out
    assert re.search(r"throughput_ratio=\d+\.\d+\s*$", out), out
