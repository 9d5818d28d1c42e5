"""Synthetic tasks for tests and the CPU quickstart.

- `arithmetic_tasks`: expressions whose value the model should get from the `calculator` tool,
  rewarded by numeric match.
- `multihop_tasks`: a generated corpus of invented countries, capitals and mayors, and two-hop
  questions ("Who is the mayor of the capital of Zorbia?") that need two `search` calls,
  rewarded by F1 (plus exact match in the components).
Everything is seeded and offline; names are invented so no model can know them.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from megatron_agent.data.tasks import Task

ARITHMETIC_SYSTEM = (
    "Use the calculator tool for arithmetic, then give the final number as <answer>NUMBER</answer>."
)
SEARCH_SYSTEM = "Answer with the search tool: look up each fact you need, then reply <answer>ANSWER</answer>."
_SYLLABLES = [
    "zor",
    "bi",
    "qua",
    "lin",
    "tar",
    "vel",
    "mon",
    "dra",
    "ke",
    "sul",
    "ria",
    "fen",
    "oth",
    "ix",
    "pa",
    "nor",
]


def _expression(rng: random.Random, depth: int) -> str:
    if depth == 0:
        return str(rng.randint(1, 99))
    op = rng.choice(["+", "-", "*"])
    left, right = _expression(rng, depth - 1), _expression(rng, rng.randint(0, depth - 1))
    return f"({left} {op} {right})" if depth > 1 else f"{left} {op} {right}"


def arithmetic_tasks(num_tasks: int, seed: int = 0, max_depth: int = 2) -> list[Task]:
    """`num_tasks` arithmetic questions with numeric ground truths (tools: calculator)."""
    from megatron_agent.envs.tools.calculator import evaluate, format_number

    rng = random.Random(seed)
    tasks = []
    for i in range(num_tasks):
        expr = _expression(rng, rng.randint(1, max_depth))
        if expr.startswith("(") and expr.endswith(")"):
            expr = expr[1:-1]
        messages = [
            {"role": "system", "content": ARITHMETIC_SYSTEM},
            {"role": "user", "content": f"What is {expr}?"},
        ]
        reward = {"fns": {"numeric": 1.0, "format": 0.1}, "ground_truth": format_number(evaluate(expr))}
        tasks.append(Task(uid=f"arith-{seed}-{i}", messages=messages, tools=["calculator"], reward=reward))
    return tasks


def _name(rng: random.Random, used: set[str], num_syllables: int, avoid: tuple[str, ...] = ()) -> str:
    """A fresh invented name, not inside (nor containing) any name in `avoid`."""
    for attempt in range(10_000):
        length = num_syllables + attempt // 50  # longer names once short ones run out
        name = "".join(rng.choice(_SYLLABLES) for _ in range(length)).capitalize()
        clash = any(name.lower() in a.lower() or a.lower() in name.lower() for a in avoid)
        if name not in used and not clash:
            used.add(name)
            return name
    raise RuntimeError("could not invent a fresh name")


def multihop_corpus(num_countries: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(passages, facts) of an invented world: each country has a capital, each capital a mayor."""
    rng = random.Random(seed)
    used: set[str] = set()
    passages, facts = [], []
    for i in range(num_countries):
        # A question names the country only: no other name of the fact may hide inside it.
        country = _name(rng, used, 3)
        city = _name(rng, used, 2, (country,))
        mayor = f"{_name(rng, used, 2, (country, city))} {_name(rng, used, 2, (country, city))}"
        river = _name(rng, used, 2, (country, city))
        facts.append({"country": country, "capital": city, "mayor": mayor})
        passages += [
            {"id": f"c{i}", "title": country, "text": f"The capital of {country} is {city}."},
            {"id": f"m{i}", "title": city, "text": f"The mayor of {city} is {mayor}."},
            {"id": f"r{i}", "title": river, "text": f"The {river} river flows through {country}."},
        ]
    rng.shuffle(passages)
    return passages, facts


def multihop_tasks(
    out_dir: str | os.PathLike, num_tasks: int, seed: int = 0
) -> tuple[list[Task], Path, Path]:
    """Write a corpus and its BM25 index under `out_dir`; return (tasks, corpus path, index dir)."""
    from megatron_agent.envs.tools.search import build_search_index

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    passages, facts = multihop_corpus(max(num_tasks, 8), seed)
    corpus = out / "corpus.jsonl"
    with open(corpus, "w") as f:
        for p in passages:
            f.write(json.dumps(p) + "\n")
    index_dir = build_search_index(corpus, out / "index")
    tasks = []
    for i, fact in enumerate(facts[:num_tasks]):
        messages = [
            {"role": "system", "content": SEARCH_SYSTEM},
            {"role": "user", "content": f"Who is the mayor of the capital of {fact['country']}?"},
        ]
        reward = {"fns": {"f1": 1.0, "format": 0.1}, "ground_truth": fact["mayor"]}
        meta = {"hops": [fact["country"], fact["capital"]]}
        tasks.append(
            Task(uid=f"hop-{seed}-{i}", messages=messages, tools=["search"], reward=reward, metadata=meta)
        )
    return tasks, corpus, index_dir
