"""bench/gpu_update.py: its FLOP count and peak table, and a tiny CPU run whose last line parses.

The GPU numbers themselves come from a GPU (scripts/gpu_check.sh); here the same code path runs
at a tiny size: build, distributed optimizer, timed steps, the report lines.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_update  # noqa: E402


def test_flops_of_the_1b_model():
    arch = gpu_update.model_arch(tiny=False)
    n = gpu_update.matmul_params(arch)
    # 16 layers x (attention 10.49M + MLP 50.33M) + the 2048 x 128256 output layer.
    assert n == 16 * (2048 * 2048 * 2 + 2 * 2048 * 512 + 3 * 2048 * 8192) + 2048 * 128256
    assert 1.2e9 < n < 1.3e9
    attention = 6 * 16 * 2048 * 32 * 64
    assert gpu_update.flops_per_token(arch, 2048) == 6 * n + attention


def test_peak_table_and_unknown_devices():
    assert gpu_update.peak_tflops("NVIDIA H200", None) == 989.0
    assert gpu_update.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0
    assert gpu_update.peak_tflops("NVIDIA H100 PCIe", None) == 756.0
    assert gpu_update.peak_tflops("NVIDIA A100-SXM4-80GB", None) == 312.0
    assert gpu_update.peak_tflops("Some GPU", 100.0) == 100.0
    with pytest.raises(ValueError, match="--peak-tflops"):
        gpu_update.peak_tflops("Some GPU", None)


def test_tiny_cpu_run_prints_the_last_line():
    cmd = [
        sys.executable,
        "bench/gpu_update.py",
        "--tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--peak-tflops",
        "1",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    spec = [line for line in lines if line.startswith("spec=local ")]
    assert len(spec) == 1, proc.stdout
    last = re.fullmatch(r"mfu=(\d+\.\d+) tokens_per_s=(\d+\.\d+)", lines[-1])
    assert last, lines[-1]
    mfu, tps = float(last.group(1)), float(last.group(2))
    assert tps > 0 and 0 < mfu < 1
    # The last line is the spec line's numbers (local: the only spec without TE).
    assert f"tokens_per_s={tps:.1f}" in spec[0] and f"mfu={mfu:.4f}" in spec[0]
    losses = re.search(r"loss_first=(\S+) loss_last=(\S+)", spec[0])
    assert float(losses.group(2)) < float(losses.group(1))  # three optimizer steps on fixed data
