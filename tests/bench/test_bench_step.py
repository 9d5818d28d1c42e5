"""The RL-step benchmark runs the real trainer and reports every phase and the two ratios.

A small run of `bench/step.py` (2 prompts x 2 samples of at most 16 tokens, one warm-up and one
timed step); the ratios are not asserted against their targets (timing belongs to the
benchmark), only that the table is complete, its shares close to 1 and the last line parses
(with the gae run's critic_ratio).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["gen", "old_log_prob", "ref", "logprob_call", "adv", "update", "sync", "rest"]


def test_step_benchmark_prints_every_phase_and_the_ratios():
    cmd = [sys.executable, "bench/step.py", "--steps", "1", "--warmup", "1"]
    cmd += ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2"]
    cmd += ["rollout.max_new_tokens=16", "rollout.max_turns=2", "data.num_synthetic_val_tasks=2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "step 1 (warm-up)" in out and "step 2:" in out, out
    seconds, shares = {}, {}
    for name in [*PHASES, "step"]:
        match = re.search(rf"^{name}\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)$", out, re.M)
        assert match, (name, out)
        seconds[name], shares[name] = float(match.group(1)), float(match.group(2))
    assert seconds["gen"] > 0 and seconds["update"] > 0 and seconds["sync"] > 0
    assert abs(sum(shares[p] for p in PHASES) - 1.0) < 0.01, out  # the phases partition the step
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(
        r"overhead_ratio=(\d+\.\d+) sync_share=(\d+\.\d+) step_s=(\d+\.\d+) tree_rss_gb=(\d+\.\d+) "
        r"tree_pss_gb=(\d+\.\d+) critic_ratio=(\d+\.\d+)",
        last,
    )
    assert match, last
    overhead, sync_share = float(match.group(1)), float(match.group(2))
    step_s, rss_gb, pss_gb, critic = (float(match.group(i)) for i in (3, 4, 5, 6))
    parts = re.search(r"values=(\d+\.\d+) update_critic=(\d+\.\d+) update_actor=(\d+\.\d+)", out)
    assert parts, out  # the gae run's median step, whose parts give the ratio
    v, c, a = (float(parts.group(i)) for i in (1, 2, 3))
    # v, c and a are printed to 3 decimals (+-5e-4 each): the ratio recomputed from them is off by up to
    rounding = 5e-4 * (2 + critic) / a
    assert critic == pytest.approx((v + c) / a, abs=rounding + 1e-3) and critic > 0
    assert step_s == pytest.approx(seconds["step"], abs=1e-3)  # the median step of the table
    # the driver, Ray, a Megatron rank and an engine each hold torch: well over 1 GB in all
    assert 1.0 < pss_gb <= rss_gb < 20.0, last
    assert 0.0 < sync_share < overhead < 1.0  # the sync is part of the overhead
    # The last line is the median step's ratios: the table's shares recomputed.
    assert abs(overhead - (1.0 - shares["gen"] - shares["update"])) < 0.002, out
    assert abs(sync_share - shares["sync"]) < 0.002, out
