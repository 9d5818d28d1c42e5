"""Convert HotpotQA JSON files into megatron-agent task rows and a passage file for the search tool.

    python examples/hotpotqa/convert.py --input hotpot_train_v1.1.json --out data/hotpotqa/train.jsonl \
        --passages data/hotpotqa/passages.jsonl [--limit N]

Input: HotpotQA's JSON (a list of {"_id", "question", "answer", "supporting_facts": [[title,
sent_id], ...], "context": [[title, [sentence, ...]], ...], "type", "level"}); several files may be
given. Output: one task per question (system prompt + question, the `search` tool, reward F1 on
`<answer>` plus a small format term) and, with --passages, one passage per distinct context
paragraph ({"id", "title", "text"}) for `build_index.py`. Rows without an answer (the test set) or
with a malformed field are skipped and counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_agent.data.synthetic import SEARCH_SYSTEM  # noqa: E402
from megatron_agent.data.tasks import Task, write_tasks  # noqa: E402


def passage_id(title: str) -> str:
    """A stable id for a context paragraph, from its title."""
    return "hp-" + hashlib.sha1(title.encode()).hexdigest()[:12]


def convert_row(row: dict) -> tuple[Task, list[dict]]:
    """(task, passages) of one HotpotQA record; ValueError naming the bad field."""
    for key in ("_id", "question", "answer", "context"):
        if key not in row:
            raise ValueError(f"missing '{key}'")
    if not isinstance(row["question"], str) or not isinstance(row["answer"], str) or not row["answer"]:
        raise ValueError("'question' and 'answer' must be non-empty strings")
    passages = []
    for item in row["context"]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
            raise ValueError("'context' entries must be [title, [sentences]]")
        title, sentences = item
        passages.append(
            {"id": passage_id(title), "title": title, "text": " ".join(s.strip() for s in sentences)}
        )
    supporting = sorted({fact[0] for fact in row.get("supporting_facts", [])})
    task = Task(
        uid=str(row["_id"]),
        messages=[{"role": "system", "content": SEARCH_SYSTEM}, {"role": "user", "content": row["question"]}],
        tools=["search"],
        reward={"fns": {"f1": 1.0, "format": 0.1}, "ground_truth": row["answer"]},
        metadata={
            "supporting_titles": supporting,
            "type": row.get("type", ""),
            "level": row.get("level", ""),
        },
    )
    return task, passages


def convert(inputs: list[Path], limit: int = 0) -> tuple[list[Task], list[dict], int]:
    """Tasks, distinct passages (first occurrence of each title) and the number of rows skipped."""
    tasks, passages, seen_titles, seen_uids, skipped = [], [], set(), set(), 0
    for path in inputs:
        with open(path) as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of HotpotQA records")
        for num, row in enumerate(rows):
            try:
                task, row_passages = convert_row(row)
                if task.uid in seen_uids:
                    raise ValueError(f"duplicate _id {task.uid!r}")
            except (ValueError, TypeError, IndexError) as exc:
                print(f"{path}: record {num} skipped: {exc}", file=sys.stderr)
                skipped += 1
                continue
            seen_uids.add(task.uid)
            for p in row_passages:
                if p["title"] not in seen_titles:
                    seen_titles.add(p["title"])
                    passages.append(p)
            tasks.append(task)
            if limit and len(tasks) >= limit:
                return tasks, passages, skipped
    return tasks, passages, skipped


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, type=Path, help="HotpotQA JSON file(s)")
    parser.add_argument("--out", required=True, type=Path, help="task file to write (.jsonl or .parquet)")
    parser.add_argument("--passages", type=Path, help="also write the context paragraphs here (jsonl)")
    parser.add_argument("--limit", type=int, default=0, help="stop after this many tasks (0: all)")
    args = parser.parse_args(argv)
    tasks, passages, skipped = convert(args.input, args.limit)
    if not tasks:
        print("no task converted", file=sys.stderr)
        return 1
    write_tasks(args.out, tasks)
    if args.passages:
        args.passages.parent.mkdir(parents=True, exist_ok=True)
        with open(args.passages, "w") as f:
            for p in passages:
                f.write(json.dumps(p) + "\n")
    print(f"{len(tasks)} tasks -> {args.out}; {len(passages)} passages; {skipped} records skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
