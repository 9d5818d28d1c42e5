"""examples/hotpotqa: the converter and the index builder on the sample rows, then a real search."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from megatron_agent.config import load_config
from megatron_agent.data.tasks import load_tasks
from megatron_agent.envs.rewards import compute_reward
from megatron_agent.envs.tools.search import Search

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "hotpotqa"
SAMPLE = RECIPE / "sample" / "hotpot_sample.json"


def _run(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_convert_index_and_search_the_sample(tmp_path):
    tasks_path, passages, index = tmp_path / "train.jsonl", tmp_path / "passages.jsonl", tmp_path / "index"
    out = _run(
        str(RECIPE / "convert.py"),
        "--input",
        str(SAMPLE),
        "--out",
        str(tasks_path),
        "--passages",
        str(passages),
    )
    assert "6 tasks" in out and "1 records skipped" in out and "missing 'answer'" in out
    tasks, bad = load_tasks(tasks_path)
    assert bad == 0 and len(tasks) == 6
    rows = {r["_id"]: r for r in json.loads(SAMPLE.read_text()) if "answer" in r}
    for task in tasks:
        assert task.tools == ["search"] and task.messages[-1]["content"] == rows[task.uid]["question"]
        assert task.reward["ground_truth"] == rows[task.uid]["answer"]
    lines = [json.loads(line) for line in passages.read_text().splitlines()]
    assert len(lines) == len({p["title"] for p in lines}) == 18

    _run(str(RECIPE / "build_index.py"), "--passages", str(passages), "--out", str(index))
    search = Search(index, top_k=2)
    task = next(t for t in tasks if t.uid == "sample-04")
    hits = search.search("founder of the Brisca Motor Company")
    assert hits[0]["title"] == "Brisca Motor Company" and "Aldo Ferrant" in hits[0]["text"]
    second_hop = search.search("Aldo Ferrant nationality engineer")
    assert second_hop[0]["title"] in task.metadata["supporting_titles"] and "Quanian" in second_hop[0]["text"]
    assert "Aldo Ferrant" in asyncio.run(search.call(query="Brisca Motor Company founder"))

    reward, parts = compute_reward(task.reward, "<answer>Quanian</answer>")
    assert parts["f1"] == 1.0 and reward > 1.0
    assert compute_reward(task.reward, "<answer>Zorbian</answer>")[1]["f1"] == 0.0


def test_recipe_configs_carry_the_field_settings():
    # validate=False: types and choices are checked; the model and data folders are the cluster's.
    for name in ("grpo.yaml", "reinforce_pp.yaml", "grpo_multinode.yaml"):
        cfg = load_config(RECIPE / name, validate=False)
        assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.lr) == (16, 5, 1e-6), name
        assert cfg.data.max_prompt_length == 4096 and cfg.tools.max_tool_response_tokens == 2048
        assert cfg.rollout.max_total_tokens - cfg.data.max_prompt_length == 2048
        assert (cfg.rollout.tp, cfg.rollout.gpu_memory_utilization, cfg.parallel.tp) == (2, 0.4, 2)
        assert cfg.tools.enabled == ["search"] and cfg.trainer.resume == "auto"
        kl = (
            cfg.algorithm.kl_reward_coef
            if cfg.algorithm.adv_estimator == "reinforce_plus_plus"
            else cfg.algorithm.kl_loss_coef
        )
        assert kl == 0.001, name
    pp = load_config(RECIPE / "reinforce_pp.yaml", validate=False)
    assert pp.algorithm.adv_estimator == "reinforce_plus_plus"
    assert load_config(RECIPE / "grpo_multinode.yaml", validate=False).ray.address == "auto"
    tiny = load_config(RECIPE / "tiny.yaml", validate=False)  # its data is made by the recipe script
    assert tiny.model.path == "" and tiny.trainer.total_steps == 2
