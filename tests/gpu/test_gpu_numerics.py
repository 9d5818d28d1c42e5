"""GPU only: log-probs on the GPU agree with the CPU path per dtype, and BF16 training lowers the loss.

The CPU path is the same worker run with CUDA_VISIBLE_DEVICES="" (megatron-core's local spec over
the CPU redirection, as in CI); the GPU runs use the local spec and, where Transformer Engine is
installed, the TE spec. Skipped without CUDA or without megatron-core.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/gpu_check.sh --wheels DIR)")

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
IMPLS = ["local", "te"] if HAS_TE else ["local"]
# |GPU - CPU| log-prob bounds, same dtype on both sides. fp32: only reduction order differs
# (TE's fused kernels a little more); bf16: both round the same weights, but every matmul
# accumulates differently and the rounding of activations diverges.
TOL = {("local", "fp32"): 1e-3, ("te", "fp32"): 2e-3, ("local", "bf16"): 0.05, ("te", "bf16"): 0.08}
TRAIN_STEPS = 6


def _worker(model, out, *args, cpu: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="4", PYTHONPATH=str(REPO))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "tests/gpu/gpu_worker.py", "--model", str(model), "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_numerics")
    model = tiny_models["qwen2"]
    cpu = _worker(model, tmp / "cpu.json", cpu=True)
    gpu = _worker(model, tmp / "gpu.json", "--impls", *IMPLS, "--train-steps", str(TRAIN_STEPS), cpu=False)
    assert cpu["device"] == "cpu" and gpu["device"] == "cuda"
    return cpu, gpu


def _max_abs(a, b) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b, strict=True) if x)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_logprobs_match_the_cpu_path(runs, impl, dtype):
    cpu, gpu = runs
    ours, ref = gpu["logprobs"][f"{impl}/{dtype}"], cpu["logprobs"][f"local/{dtype}"]
    assert all(torch.isfinite(torch.tensor(x)).all() for x in ours)
    diff = _max_abs(ours, ref)
    assert diff <= TOL[(impl, dtype)], f"{impl}/{dtype}: max |GPU - CPU| log-prob {diff:.3g}"
    # And bf16 stays near fp32 on the GPU (a bf16 path that ignored its weights would not).
    assert _max_abs(gpu["logprobs"][f"{impl}/bf16"], gpu["logprobs"][f"{impl}/fp32"]) < 0.1


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_training_on_gpu_lowers_the_loss(runs, impl):
    train = runs[1]["train"][impl]
    losses = train["losses"]
    assert len(losses) == TRAIN_STEPS and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses  # the CPU run of the same loop: 6.26 -> 3.67 in 4 steps
    assert all(0 < g < 100 for g in train["grad_norms"]), train["grad_norms"]
    assert train["fp32_grad_buffers"], "gradients were not reduced in fp32 (grad_reduce_in_fp32)"
