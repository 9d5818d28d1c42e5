"""Shared fixtures: tiny HF models made once per test session, helpers to launch torchrun."""

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


def read_dump(run_dir, step: int) -> list[dict]:
    """The rows of `<run_dir>/rollouts/step_{step:06d}.jsonl`."""
    path = Path(run_dir) / "rollouts" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
