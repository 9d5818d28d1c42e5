"""The driver's inputs (base model, tokenizer, tasks: `Trainer.__init__`) import neither
transformers' model registry nor torch._dynamo once the per-user cache holds the tokenizer's class
and the tiny base model (docs/lean.md): 1.5-2 s of the start-up and about 150 MB of the driver.
Nor torch (1 s), on a CPU-only torch build: the driver imports it once its engines are created."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, fresh_python

INPUTS = """
import json, sys
from megatron_agent.config import load_config
from megatron_agent.platform.versions import check_versions
from megatron_agent.train.run import async_pipeline
from megatron_agent.train.trainer import Trainer
cfg = load_config("examples/quickstart/config.yaml", [f"trainer.run_dir={sys.argv[1]}", "sft.steps=0"])
trainer = Trainer(cfg)
async_pipeline(trainer, None); check_versions()  # what `Run.train` does next, before the workers
heavy = [m for m in ("transformers.models.auto", "transformers.generation", "torch._dynamo", "torch")
         if m in sys.modules]
print(json.dumps({"heavy": heavy, "tasks": len(trainer.train_tasks), "eos": trainer.tokenizer.eos_token_id}))
"""


def inputs_of(run_dir, cache) -> dict:
    return fresh_python(INPUTS, run_dir, env={"MEGATRON_AGENT_CACHE": str(cache)})


def test_the_drivers_inputs_skip_the_model_registry_once_cached(tmp_path):
    first = inputs_of(tmp_path / "run1", tmp_path / "cache")  # makes and records: the registry once
    assert "transformers.models.auto" in first["heavy"]
    second = inputs_of(tmp_path / "run2", tmp_path / "cache")
    assert second["heavy"] == [], second
    assert second["tasks"] == first["tasks"] and second["eos"] == first["eos"]
    base1, base2 = tmp_path / "run1" / "base_model", tmp_path / "run2" / "base_model"
    assert sorted(p.name for p in base1.iterdir()) == sorted(p.name for p in base2.iterdir())
    assert all((base1 / p.name).read_bytes() == p.read_bytes() for p in base2.iterdir())


BEFORE_RAY = """
import json, sys
from megatron_agent.config import load_config
from megatron_agent.data.tasks import read_task_files
from megatron_agent.train.run import Run, check_inputs_up_front
from megatron_agent.train.run_state import find_resume
cfg = load_config("examples/quickstart/config.yaml", [f"trainer.run_dir={sys.argv[1]}", *sys.argv[2:]])
Run(cfg); find_resume(cfg); check_inputs_up_front(cfg, sft=True); read_task_files(cfg)
print(json.dumps("torch" in sys.modules))
"""


def test_nothing_before_rays_start_imports_torch(tmp_path):
    """What `Run` does before Ray begins (config, resume folder, inputs, task files) leaves torch
    (1 s to import) out; a GPU-only setting still asks torch, and is refused."""
    assert fresh_python(BEFORE_RAY, tmp_path, timeout=120) is False
    gpu_only = subprocess.run(
        [sys.executable, "-c", BEFORE_RAY, str(tmp_path), "model.fp8=delayed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gpu_only.returncode != 0 and "model.fp8='delayed' needs Transformer Engine" in gpu_only.stderr
