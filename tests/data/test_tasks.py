"""Task files (jsonl, parquet) with bad rows, and the synthetic task generators."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from megatron_agent.data.synthetic import arithmetic_tasks, multihop_tasks
from megatron_agent.data.tasks import load_tasks, write_tasks
from megatron_agent.envs.rewards import compute_reward
from megatron_agent.envs.tools.calculator import evaluate, format_number
from megatron_agent.envs.tools.search import Search

GOOD = {
    "uid": "a",
    "prompt": [{"role": "user", "content": "1+1?"}],
    "tools": ["calculator"],
    "reward": {"fn": "numeric", "ground_truth": "2"},
}


def test_bad_rows_are_skipped_counted_and_named(tmp_path, caplog):
    lines = [
        json.dumps(GOOD),
        "{not json",
        json.dumps({**GOOD, "uid": "b", "prompt": []}),
        json.dumps({**GOOD, "uid": "c", "reward": {"ground_truth": 1}}),
        "",
        json.dumps({**GOOD, "uid": "d", "prompt": "plain string prompt", "extra": 5}),
        json.dumps({**GOOD, "uid": "a"}),
        json.dumps([1, 2]),
        json.dumps({**GOOD, "uid": "e", "tools": "calculator"}),
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        tasks, num_skipped = load_tasks(path)
    assert [t.uid for t in tasks] == ["a", "d"] and num_skipped == 6
    assert tasks[1].messages == [{"role": "user", "content": "plain string prompt"}] and tasks[
        1
    ].metadata == {"extra": 5}
    for row_num in (2, 3, 4, 7, 8, 9):
        assert f"row {row_num} skipped" in caplog.text
    assert "duplicate uid 'a'" in caplog.text


def test_parquet_round_trip(tmp_path):
    tasks = arithmetic_tasks(5, seed=3)
    path = write_tasks(tmp_path / "t.parquet", tasks)
    back, num_skipped = load_tasks(path)
    assert num_skipped == 0 and [t.to_row() for t in back] == [t.to_row() for t in tasks]


def test_arithmetic_tasks_need_the_calculator():
    tasks = arithmetic_tasks(20, seed=1)
    assert len({t.uid for t in tasks}) == 20 and all(t.tools == ["calculator"] for t in tasks)
    for t in tasks:
        expr = t.messages[-1]["content"][len("What is ") : -1]
        assert format_number(evaluate(expr)) == t.reward["ground_truth"]
        total, _ = compute_reward(t.reward, f"<answer>{t.reward['ground_truth']}</answer>")
        assert total > 1.0
    assert arithmetic_tasks(3, seed=1)[0].to_row() == tasks[0].to_row()  # seeded


def test_multihop_tasks_are_answerable_in_two_searches(tmp_path):
    tasks, corpus, index = multihop_tasks(tmp_path, 6, seed=2)
    tool = Search(index, top_k=1)
    for t in tasks:
        country, capital = t.metadata["hops"]
        first = asyncio.run(tool.call(query=f"capital of {country}"))
        assert capital in first
        second = asyncio.run(tool.call(query=f"mayor of {capital}"))
        assert t.reward["ground_truth"] in second
        assert country in t.messages[-1]["content"] and capital not in t.messages[-1]["content"]


def test_a_task_set_whose_prompts_are_all_too_long_is_an_error_naming_the_key(tmp_path, caplog):
    from megatron_agent.config import ConfigError, load_config
    from megatron_agent.train.trainer import Trainer
    from tests.conftest import REPO

    overrides = ["data.num_synthetic_tasks=4", "data.max_prompt_length=8", f"trainer.run_dir={tmp_path}"]
    cfg = load_config(REPO / "examples/quickstart/config.yaml", overrides)
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert "no usable tasks in the synthetic set (4 skipped" in str(err.value), err.value
    assert "data.max_prompt_length=8" in str(err.value), err.value
    assert "skipped 4 tasks longer than data.max_prompt_length=8" in caplog.text
