"""A user's mistake given to `train`, `sft` or `rollout` is refused up front: exit status 2, one
message naming the input, no traceback, within seconds (before Ray, vLLM or a worker starts), and
an existing run folder is left as it was.

(`score` and the converters: tests/convert/test_bad_input_cli.py; each config field's range:
tests/config/test_constraints.py.)
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_agent.checkpoint.manifest import write_manifest

FAST_S = 30.0
"""A refusal takes a second or two; Ray, vLLM or a Megatron worker would take far longer."""


def _run(*args: str, cwd: Path) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_agent", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` and its sha256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Bad files of every kind, and a run folder holding a complete (small) checkpoint."""
    root = tmp_path_factory.mktemp("bad_inputs")
    files = {
        "bad_yaml": ("run.yaml", "trainer: [1\n"),
        "dup_yaml": ("dup.yaml", "trainer:\n  seed: 1\n  total_steps: 2\n  seed: 3\n"),
        "empty": ("empty.jsonl", ""),
        "not_utf8": ("latin1.jsonl", '{"prompt": "caf\xe9"}\n'.encode("latin-1")),
        "bad_sft": ("sft.jsonl", '{"messages": 5}\nnot json\n'),
    }
    paths = {}
    for key, (name, content) in files.items():
        path = root / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        paths[key] = path
    ckpt = root / "run" / "checkpoints" / "step_000002"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 2}))
    (ckpt / "model" / "weights.bin").write_bytes(b"\x01" * 64)
    (ckpt / "trainer").mkdir()
    (ckpt / "trainer" / "driver.json").write_text(json.dumps({"step": 2}))
    write_manifest(ckpt, fsync=False)
    paths["run_dir"], paths["ckpt"] = root / "run", ckpt
    altered = root / "altered"
    (altered / "model").mkdir(parents=True)
    (altered / "meta.json").write_text(json.dumps({"step": 0}))
    (altered / "model" / "weights.bin").write_bytes(b"\x01" * 64)
    write_manifest(altered, fsync=False)
    (altered / "model" / "weights.bin").write_bytes(b"\x02" * 64)  # same size, other bytes
    paths["altered"] = altered
    return paths


CASES = [
    # (id, command line with {placeholders}, what the message must name)
    (
        "negative_mini_batch",
        "train actor.ppo_mini_batch_size=-4",
        "actor.ppo_mini_batch_size=-4 must be >= 0",
    ),
    ("negative_total_steps", "train trainer.total_steps=-1", "trainer.total_steps=-1 must be >= 0"),
    ("negative_save_freq", "train checkpoint.save_freq=-2", "checkpoint.save_freq=-2 must be >= 0"),
    (
        "micro_batch_tokens",
        "train actor.micro_batch_tokens=-100",
        "actor.micro_batch_tokens=-100 must be >= 1",
    ),
    ("negative_lr", "train actor.lr=-1", "actor.lr=-1.0 must be >= 0"),
    ("temperature", "train rollout.temperature=-1", "rollout.temperature=-1.0 must be >= 0"),
    ("max_new_tokens", "train rollout.max_new_tokens=-5", "rollout.max_new_tokens=-5 must be >= 1"),
    (
        "unknown_choice",
        "train algorithm.loss_agg_mode=bogus",
        "'algorithm.loss_agg_mode'='bogus': choose one of",
    ),
    ("bad_yaml", "train --config {bad_yaml}", "is not valid YAML at line 2"),
    ("config_folder", "train --config {run_dir}", "is a folder; give a YAML file"),
    ("duplicate_key", "train --config {dup_yaml}", "key 'seed' is given twice (lines 2 and 4)"),
    ("task_not_utf8", "train data.train_path={not_utf8}", "{not_utf8}: row 1 skipped: not UTF-8 text"),
    ("init_from_altered", "train trainer.init_from={altered}", "weights.bin"),
    (
        "critic_init_from_without_a_critic",
        "train algorithm.adv_estimator=gae critic.init_from={ckpt}",
        "critic.init_from={ckpt!r} holds no critic",
    ),
    ("sft_missing_data", "sft sft.steps=2 sft.data_path={root}/none.jsonl", "sft.data_path="),
    ("sft_empty_data", "sft sft.steps=2 sft.data_path={empty}", "has no usable rows"),
    ("sft_malformed_data", "sft sft.steps=2 sft.data_path={bad_sft}", "has no usable rows (2 skipped"),
    ("sft_no_steps", "sft", "sft.steps must be >= 1"),
    (  # 4 engines x 1000 calls x 64 GiB on this machine: far beyond half of any machine's memory
        "python_tool_worst_case",
        "train tools.enabled=[calculator,python] rollout.num_engines=4 tools.max_concurrent=1000 "
        "tools.python.memory_mb=65536",
        "tools.max_concurrent=1000 x tools.python.memory_mb=65536 x 4 engines on this machine",
    ),
    ("rollout_n", "rollout rollout.n=-1", "rollout.n=-1 must be >= 1"),
    ("rollout_model", "rollout --model {root}/no_model", "is not an HF model folder"),
    ("rollout_not_utf8", "rollout --data {not_utf8}", "no valid task rows"),
]


@pytest.mark.parametrize(("line", "named"), [pytest.param(c[1], c[2], id=c[0]) for c in CASES])
def test_bad_input_is_refused_up_front(inputs, line, named):
    fill = {k: str(v) for k, v in inputs.items()} | {"root": str(inputs["run_dir"].parent)}
    run_dir = inputs["run_dir"]
    before = _tree(run_dir)
    args = line.format(**fill).split() + [f"trainer.run_dir={run_dir}"]
    status, output, seconds = _run(*args, cwd=run_dir.parent)
    assert status == 2, output
    assert named.format(**fill) in output, output
    assert "Traceback" not in output, output
    assert seconds < FAST_S, f"took {seconds:.1f} s: something started before the input was checked"
    assert _tree(run_dir) == before, "the run folder changed"


def test_debug_shows_the_traceback(inputs):
    status, output, _ = _run("train", "actor.lr=-1", "--debug", cwd=inputs["run_dir"].parent)
    assert status == 2 and "Traceback" in output and "actor.lr=-1.0 must be >= 0" in output
