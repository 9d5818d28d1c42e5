"""scripts/gpu_check.sh on a machine without CUDA: it says so, every GPU test skips with its
reason, the benchmark is skipped, and it exits 0; `--wheels` installs offline into a private
folder; bad arguments are errors. (shellcheck runs over it in tests/ops/test_lint.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the report of a machine without CUDA"
)


def _run(tmp_path, *args, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", **env)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600
    )


def _wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (module `gpu_check_probe`), written by hand: no build, no network."""
    path = folder / "gpu_check_probe-0.1-py3-none-any.whl"
    dist = "gpu_check_probe-0.1.dist-info"
    files = {
        "gpu_check_probe.py": "VALUE = 42\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 0.1\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def test_report_without_cuda_skips_everything_and_exits_0(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels)
    site = tmp_path / "site"
    proc = _run(tmp_path, "--wheels", str(wheels), GPU_CHECK_SITE=str(site))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    report = out[out.index("gpu_check report") :]
    assert "no CUDA GPU on this machine" in report
    assert f"installed 1 wheel(s) from {wheels} into {site}" in report
    assert (site / "gpu_check_probe.py").read_text() == "VALUE = 42\n"  # offline install, private folder
    assert re.search(r"torch 2\.\S+, CUDA none, device: none", report)
    assert re.search(r"megatron-core \S+, transformer-engine \S+, vllm \S+", report)
    skipped = re.findall(r"^  SKIPPED \[\d+\] (\S+?):\d+: (.+)$", report, re.M)
    files = {f for f, _ in skipped}
    assert {
        "tests/gpu/test_gpu_numerics.py",
        "tests/gpu/test_cuda_ipc.py",
        "tests/gpu/test_fp8_rollout.py",
    } <= files
    assert "tests/sync/test_sync_gpu.py" in files
    assert all("CUDA" in reason for _, reason in skipped), skipped
    summary = re.search(r"^  summary: (\d+) skipped", report, re.M)
    assert summary and int(summary.group(1)) >= 8
    assert "passed" not in report.split("summary:")[1].splitlines()[0]
    assert "benchmark (bench/gpu_update.py --steps 3 --warmup 1): skipped: no CUDA GPU" in report
    assert report.rstrip().endswith("result: ok")


def test_bad_arguments_are_errors(tmp_path):
    proc = _run(tmp_path, "--wheels", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "is not a folder" in proc.stderr
    proc = _run(tmp_path, "--wheels", str(tmp_path))
    assert proc.returncode == 2 and "no .whl files" in proc.stderr
    proc = _run(tmp_path, "--gpus", "2")
    assert proc.returncode == 2 and "unknown argument '--gpus'" in proc.stderr
