"""Shared fixtures: tiny HF models made once per test session, helpers to launch torchrun and
fresh Python processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random HF checkpoints: llama (tied, untied; llama3 rope), qwen2 (QKV bias), qwen3 (q/k norm)."""
    from megatron_agent.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    specs = {
        "llama_tied": ("llama", True),
        "llama_untied": ("llama", False),
        "qwen2": ("qwen2", False),
        "qwen3": ("qwen3", False),
    }
    return {
        name: make_tiny_model(root / name, fam, tied=tied, seed=i)
        for i, (name, (fam, tied)) in enumerate(specs.items())
    }


def run_torchrun(script_args: list[str], nproc: int, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node nproc ARGS...` from the repository root; fail with its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(_free_port()),
    ]
    proc = subprocess.run(
        cmd + script_args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def fresh_python(code: str, *args, env: dict | None = None, timeout: float = 300):
    """Run `code` in a fresh Python process from the repository root with `args` as its argv (and
    `env` over this process's environment); fail with the tail of its stderr when it fails, else
    return its last stdout line read as JSON (what a probe reports of its own process)."""
    out = subprocess.run(
        [PYTHON, "-c", code, *map(str, args)],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# A short SFT and tiny RL steps of the quickstart config (two prompts x two samples, 4 tasks).
TINY_SFT_RL = [
    "sft.steps=2",
    "sft.batch_size=8",
    "sft.num_synthetic=64",
    "sft.warmup_steps=0",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=1",
    "rollout.n=2",
    "rollout.max_new_tokens=16",
    "data.num_synthetic_tasks=4",
    "data.num_synthetic_val_tasks=2",
]


TINY_QUICKSTART = [
    "sft.steps=2",
    "sft.num_synthetic=32",
    "sft.batch_size=8",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "rollout.max_new_tokens=24",
    "data.num_synthetic_val_tasks=2",
    "trainer.test_freq=0",
]
"""The quickstart cut to a few seconds a step: the base of the whole-trainer tests' overrides."""


def quickstart_train_cmd(run_dir, *overrides) -> list[str]:
    """`python -m megatron_agent train` on the quickstart config in `run_dir`, with overrides."""
    return [
        PYTHON,
        "-m",
        "megatron_agent",
        "train",
        "--config",
        "examples/quickstart/config.yaml",
        f"trainer.run_dir={run_dir}",
        *overrides,
    ]


def train_quickstart(run_dir, *overrides, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `quickstart_train_cmd(run_dir, *overrides)` (one thread per process); fail the test,
    with the end of its output, unless it exits 0."""
    proc = subprocess.run(
        quickstart_train_cmd(run_dir, *overrides),
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def metrics_by_step(run_dir) -> dict[int, dict]:
    """The rows of `<run_dir>/metrics.jsonl` by step."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def repo_on_pythonpath():
    """The repository on PYTHONPATH while a module's trainer runs: its Ray workers load test
    tools and rewards (`tests.*`) by dotted path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        yield


def sigterm_after_step_1(
    cmd: list[str], run_dir, env: dict, timeout: float = 900
) -> subprocess.CompletedProcess:
    """Start `cmd` (a train run in `run_dir`), send it SIGTERM as soon as step 1's rollout dump
    exists (so during step 2), and return how it ended."""
    import signal
    import time

    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not (Path(run_dir) / "rollouts" / "step_000001.jsonl").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "step 1 never finished"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_dump(run_dir, step: int) -> list[dict]:
    """The rows of `<run_dir>/rollouts/step_{step:06d}.jsonl`."""
    path = Path(run_dir) / "rollouts" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- test tiers
# Every test gets one tier marker from its file: `unit` (no process started: pure Python, torch
# in this process, an in-process engine), `dist` (torchrun with several gloo ranks, a Ray
# cluster, or a subprocess of the CLI), `e2e` (whole trainer runs). Files not listed are `unit`.
DIST_FILES = {
    "bench/test_bench_gpu_update.py",
    "bench/test_bench_rollout.py",
    "bench/test_bench_step.py",
    "bench/test_bench_update.py",
    "convert/test_cli_defects.py",
    "convert/test_convert.py",
    "models/test_bad_inputs.py",
    "models/test_fast_build.py",
    "models/test_layouts.py",
    "models/test_critic.py",
    "models/test_logprobs.py",
    "models/test_recompute.py",
    "models/test_score_parallel.py",
    "ops/test_gpu_check.py",
    "ops/test_hotpotqa.py",
    "ops/test_lint.py",
    "ops/test_slurm_launch.py",
    "ops/test_versions.py",
    "platform/test_core_sharing.py",
    "rl/test_rl_distributed.py",
    "rollout/test_agent_loop.py",
    "rollout/test_command.py",
    "rollout/test_vllm_vs_megatron.py",
    "sync/test_engine_process_env.py",
    "sync/test_fp8.py",
    "sync/test_shm_segment.py",
    "sync/test_sync_failures.py",
    "sync/test_sync_gpu.py",
    "sync/test_sync_layouts.py",
    "sync/test_sync_ray.py",
    "train/test_cluster.py",
    "train/test_lean_cluster.py",
    "train/test_pipeline_forward.py",
    "train/test_sft_quickstart.py",
    "train/test_sft_step.py",
    "train/test_startup.py",
}
E2E_FILES = {
    "train/test_async.py",
    "train/test_async_cores.py",
    "train/test_driver_kill.py",
    "convert/test_export_training.py",
    "gpu/test_gpu_numerics.py",
    "ops/test_hotpotqa_recipe.py",
    "train/test_deterministic_resume.py",
    "train/test_ppo_critic.py",
    "train/test_engine_restart.py",
    "train/test_faults.py",
    "train/test_faults_resume.py",
    "train/test_quickstart_slow.py",
    "train/test_resume.py",
    "train/test_resume_paths.py",
    "train/test_train_e2e.py",
    "train/test_train_layouts.py",
}
# Long tests kept out of `make test` and run by `make test-slow` (README, "Tests"), with the
# seconds each takes alone on a 2-core machine. A prefix covers every test it starts.
SLOW = {
    "train/test_deterministic_resume.py::test_a_run_killed": 137,  # 5 trainer launches
    "train/test_async.py::test_eta_1": 230,  # 5 trainer launches
    "train/test_async.py::test_staleness_0_with_a_critic": 45,
    "train/test_async.py::test_eta_1_with_a_critic": 90,
    "train/test_async.py::test_sigterm": 90,
    "train/test_async.py::test_an_engine": 60,
    "train/test_async.py::test_eta_2": 45,
    "train/test_async.py::test_a_sync_that_cannot": 70,
    "train/test_resume_paths.py": 77,
    "convert/test_export_training.py": 73,
    "convert/test_convert.py": 63,
    "convert/test_quantized_export.py::test_quantized_export": 32,  # the format: tests/quant/test_hf_folder.py
    "convert/test_quantized_export.py::test_verify_fails": 1,  # shares the export's fixture
    "bench/test_bench_rollout.py": 20,
    "bench/test_bench_step.py": 31,
    "bench/test_bench_gpu_update.py": 6,
    "train/test_engine_restart.py": 54,
    "ops/test_hotpotqa_recipe.py": 38,
    "models/test_fast_build.py": 25,
    # covered in `make test` by the separate critic's run, which resumes on the actor's ranks
    "train/test_ppo_critic.py::test_the_critic_resumes_exactly": 32,
    "train/test_ppo_critic.py::test_critic_init_from": 21,
    # QAT keeps no state of its own; `make test` runs its gap test, which makes the run resumed here
    "train/test_quantized_rollout.py::test_a_qat_run_resumes_exactly": 35,
}


def tier_of(nodeid: str) -> str:
    """'unit', 'dist' or 'e2e' for a test id like 'tests/train/test_resume.py::test_x'."""
    path = nodeid.split("::")[0].removeprefix("tests/")
    return "e2e" if path in E2E_FILES else "dist" if path in DIST_FILES else "unit"


def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier, and the long ones listed in SLOW as `slow`."""
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item.nodeid)))
        if any(item.nodeid.removeprefix("tests/").startswith(prefix) for prefix in SLOW):
            item.add_marker(pytest.mark.slow)
