"""Quantized rollout weights in the real trainer (vLLM engine, Megatron rank, Ray): NVFP4 weights
dequantized into the engine (`rollout.quantization=nvfp4_qdq`) open a policy gap that the
mismatch metrics measure; quantization-aware training (`actor.qat=nvfp4_w4a16`) closes it, the
actor computing with the engine's weights."""

from __future__ import annotations

import json
import os
import subprocess

from tests.conftest import REPO, TINY_QUICKSTART, quickstart_train_cmd

TINY = [
    *TINY_QUICKSTART,
    "checkpoint.save_freq=0",
    "logging.plot=false",
    "logging.progress_bars=false",
    "trainer.total_steps=2",
    "rollout.quantization=nvfp4_qdq",
]


def _run(run_dir, *overrides) -> dict[int, dict]:
    proc = subprocess.run(
        quickstart_train_cmd(run_dir, *TINY, *overrides),
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def test_qat_closes_the_policy_gap_of_nvfp4_rollout_weights(tmp_path):
    plain, qat = _run(tmp_path / "plain"), _run(tmp_path / "qat", "actor.qat=nvfp4_w4a16")
    gap = {
        name: [m[s]["mismatch/mean_abs_diff"] for s in (1, 2)] for name, m in (("plain", plain), ("qat", qat))
    }
    ratio = min(gap["plain"]) / max(max(gap["qat"]), 1e-9)
    print(f"mismatch/mean_abs_diff without QAT {gap['plain']}, with QAT {gap['qat']}: {ratio:.3g}x smaller")
    assert min(gap["plain"]) > 1e-2  # NVFP4 weights: a gap far above fp32's (~1e-6)
    assert ratio >= 5
    # Either way the probe checks the sync alone, at fp32's tolerance: its actor forward computes
    # with the engine's quantized weights (QAT's, or switched on for the probe only).
    assert plain[0]["sync/probe_max_abs"] < 1e-4 and qat[0]["sync/probe_max_abs"] < 1e-4
    assert plain[1]["mismatch/is_weight_max"] > 1.01  # truncated IS (rollout_is=auto) is at work
