"""Tasks: rows of a jsonl or parquet file with `prompt` (chat messages), `tools`, `reward`.

Row format (jsonl shown; parquet columns are the same, nested values as JSON strings or structs):

    {"uid": "q1", "prompt": [{"role": "user", "content": "What is 3*4?"}],
     "tools": ["calculator"], "reward": {"fn": "numeric", "ground_truth": "12"}}

`prompt` may also be a plain string (one user message). `uid` defaults to the row number. A bad
row is skipped with a warning naming its row number and counted; it never stops the run.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_agent.envs.rewards import reward_weights
from megatron_agent.errors import InputError

logger = logging.getLogger(__name__)
_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Task:
    """One prompt to roll out."""

    uid: str
    """Unique id."""
    messages: list[dict]
    """Chat messages of the prompt."""
    tools: list[str] = field(default_factory=list)
    """Names of the tools this task may use (empty: none)."""
    reward: dict = field(default_factory=dict)
    """Reward spec: {'fn' or 'fns': ..., 'ground_truth': ...}."""
    metadata: dict = field(default_factory=dict)
    """Anything else in the row."""

    def to_row(self) -> dict:
        """The jsonl row form."""
        return {
            "uid": self.uid,
            "prompt": self.messages,
            "tools": self.tools,
            "reward": self.reward,
            **self.metadata,
        }


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in ("[", "{"):
        return json.loads(value)
    return value


def parse_task(row: Any, row_num: int) -> Task:
    """A `Task` from one row; ValueError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError("the row is not an object")
    prompt = _maybe_json(row.get("prompt"))
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("'prompt' must be a non-empty list of chat messages or a string")
    for msg in prompt:
        if (
            not isinstance(msg, dict)
            or msg.get("role") not in _ROLES
            or not isinstance(msg.get("content"), str)
        ):
            raise ValueError(f"bad message {msg!r}: need role in {_ROLES} and string content")
    tools = _maybe_json(row.get("tools")) or []
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise ValueError("'tools' must be a list of tool names")
    reward = _maybe_json(row.get("reward"))
    if not isinstance(reward, dict):
        raise ValueError("'reward' must be a mapping with 'fn'/'fns' and 'ground_truth'")
    reward_weights(reward)
    uid = str(row.get("uid", row_num))
    metadata = {k: v for k, v in row.items() if k not in ("uid", "prompt", "tools", "reward")}
    return Task(
        uid=uid, messages=[dict(m) for m in prompt], tools=list(tools), reward=dict(reward), metadata=metadata
    )


def read_rows(path: Path):
    """(row number, row or None, error or None) for each row of a .jsonl or .parquet file; a
    line that is not UTF-8 or not JSON is an error of its row; an unreadable parquet file is an
    `InputError` naming it."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{path} is not a readable parquet file: {exc}") from None
        for num, row in enumerate(table.to_pylist(), 1):
            yield num, row, None
        return
    with open(path, "rb") as f:
        for num, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield num, None, f"not UTF-8 text ({exc.reason} at byte {exc.start} of the line)"
                continue
            if not line.strip():
                continue
            try:
                yield num, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield num, None, f"not JSON ({exc})"


def load_tasks(path: str | os.PathLike) -> tuple[list[Task], int]:
    """Tasks of a .jsonl or .parquet file and the number of bad rows skipped (each warned about)."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".parquet", ".json"):
        raise InputError(f"{path}: task files are .jsonl or .parquet")
    if not path.is_file():
        raise InputError(f"task file {path} does not exist")
    tasks, num_skipped, seen = [], 0, set()
    for num, row, error in read_rows(path):
        try:
            if error:
                raise ValueError(error)
            task = parse_task(row, num)
            if task.uid in seen:
                raise ValueError(f"duplicate uid {task.uid!r}")
        except (ValueError, TypeError) as exc:
            logger.warning("%s: row %d skipped: %s", path, num, exc)
            num_skipped += 1
            continue
        seen.add(task.uid)
        tasks.append(task)
    return tasks, num_skipped


def write_tasks(path: str | os.PathLike, tasks: list[Task]) -> Path:
    """Write tasks as jsonl (or parquet when the name ends in .parquet, nested fields as JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [t.to_row() for t in tasks]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        flat = [{k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()} for r in rows]
        pq.write_table(pa.Table.from_pylist(flat), path)
    else:
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return path


def read_task_files(cfg) -> tuple[tuple[list[Task] | None, int], tuple[list[Task] | None, int]]:
    """((train tasks, bad rows skipped), (validation tasks, skipped)) of `data.train_path` and
    `data.val_path`; (None, 0) for an empty path (synthetic tasks). A file without a usable task
    is a `ConfigError` naming it."""
    from megatron_agent.config import ConfigError

    def read(path: str) -> tuple[list[Task] | None, int]:
        if not path:
            return None, 0
        tasks, num_skipped = load_tasks(path)
        if not tasks:
            raise ConfigError(f"no usable tasks in {path} ({num_skipped} skipped, each named above)")
        return tasks, num_skipped

    return read(cfg.data.train_path), read(cfg.data.val_path)
