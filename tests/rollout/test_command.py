"""`python -m megatron_agent rollout` end to end: a task file with a bad row, dump and metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_agent.data.synthetic import arithmetic_tasks
from megatron_agent.data.tasks import write_tasks
from megatron_agent.rollout.dump import DUMP_FIELDS

REPO = Path(__file__).resolve().parents[2]


def test_rollout_command_writes_dump_and_prints_stats(tiny_model_dir, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", arithmetic_tasks(3, seed=5))
    with open(tasks, "a") as f:
        f.write('{"uid": "broken", "prompt": 5}\n')
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "megatron_agent",
        "rollout",
        "--config",
        str(REPO / "examples" / "rollout_cpu.yaml"),
        "--model",
        str(tiny_model_dir),
        "--data",
        str(tasks),
        "--run-dir",
        str(run_dir),
        "rollout.n=2",
        "rollout.max_new_tokens=16",
        "rollout.max_total_tokens=1024",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "row 4 skipped" in proc.stderr
    assert "critic/score/mean" in proc.stdout and "tool/errors" in proc.stdout
    rows = [
        json.loads(line) for line in (run_dir / "rollouts" / "step_000000.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 6 and all(tuple(r) == DUMP_FIELDS for r in rows)
    for r in rows:
        assert (
            len(r["response_ids"])
            == len(r["token_source"])
            == len(r["loss_mask"])
            == len(r["rollout_logprobs"])
        )
        assert all(
            (lp is not None) == (src == "sampled") == bool(m)
            for lp, src, m in zip(r["rollout_logprobs"], r["token_source"], r["loss_mask"])
        )
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["data/skipped_rows"] == 1 and metrics["rollout/num_trajectories"] == 6


def test_rollout_command_rejects_a_bad_key(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_agent", "rollout", "rollout.temprature=0.5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "rollout.temperature" in proc.stderr
