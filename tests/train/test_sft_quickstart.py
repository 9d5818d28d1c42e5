"""The quickstart's SFT leaves RL a learnable gap (slow: about 2-6 minutes on 2 CPU cores).

After SFT on `quickstart_sft_data` (tool_use_rate 0.3) the model, sampled, calls the calculator
on about 30% of answers and then answers correctly; greedily it guesses, so greedy accuracy is
near zero. Runs tests/train/sft_quickstart_probe.py (SFT with `sft_step`, HF export, the rollout
command for evaluation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_quickstart_sft_leaves_a_gap_for_rl(tmp_path):
    cmd = [
        sys.executable,
        "tests/train/sft_quickstart_probe.py",
        "--out",
        str(tmp_path),
        "--steps",
        "300",
        "--lr",
        "2e-3",
        "--rate",
        "0.3",
        "--eval-tasks",
        "64",
        "--sampled-n",
        "2",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    info = json.loads((tmp_path / "summary.json").read_text())
    assert info["sft_loss_last"] < 0.2
    assert info["greedy"]["accuracy"] <= 0.1 and info["greedy"]["tool_call_rate"] <= 0.1
    assert 0.15 <= info["sampled"]["tool_call_rate"] <= 0.45
    assert info["sampled"]["accuracy_given_tool"] >= 0.7  # the tool branch works: RL has a signal
