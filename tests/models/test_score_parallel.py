"""`score` over two data-parallel ranks writes the same lines, in order, as one rank."""

from __future__ import annotations

import json

from tests.conftest import run_torchrun
from tests.models.test_bad_inputs import run_score, write_lines


def test_score_data_parallel_matches_single_rank(tmp_path, tiny_models):
    rows = [{"input_ids": list(range(3 + 7 * k, 10 + 11 * k))} for k in range(5)] + [{"input_ids": [7]}]
    data = write_lines(tmp_path / "in.jsonl", rows)
    single, dp2 = tmp_path / "single.jsonl", tmp_path / "dp2.jsonl"
    assert run_score(tiny_models["qwen3"], data, single).returncode == 0
    run_torchrun(
        [
            "-m",
            "megatron_agent",
            "score",
            "--model",
            str(tiny_models["qwen3"]),
            "--data",
            str(data),
            "--out",
            str(dp2),
            "--batch-size",
            "4",
        ],
        nproc=2,
    )
    a = [json.loads(line)["logprobs"] for line in single.read_text().splitlines()]
    b = [json.loads(line)["logprobs"] for line in dp2.read_text().splitlines()]
    assert [len(x) for x in b] == [len(r["input_ids"]) - 1 for r in rows]
    assert max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q)) < 1e-5
