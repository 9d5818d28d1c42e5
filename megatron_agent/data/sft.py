"""SFT data: chat rows with tool calls, their token ids and assistant-only loss masks.

Row format (jsonl shown; parquet columns are the same, nested values as JSON strings or structs):

    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "What is 12 + 7?"},
                  {"role": "assistant", "content": "<tool_call>{\\"name\\": \\"calculator\\", ...}</tool_call>"},
                  {"role": "tool", "content": "19"},
                  {"role": "assistant", "content": "<answer>19</answer>"}],
     "tools": [{"type": "function", "function": {"name": "calculator", ...}}]}

Assistant tool calls are written in the Qwen2.5 / Hermes form the agent loop parses (inside the
content) or as OpenAI-style `tool_calls` that the chat template renders. `tools` (JSON schemas)
is optional. A bad row is skipped with a warning naming its row number and counted.

`tokenize_conversation` builds the ids turn by turn from the chat template's own token ids
(growing prefixes rendered with `tokenize=True`, each checked to be a prefix of the next), never
by decoding and re-encoding, and marks for loss exactly what the model must produce in each
assistant turn: its content, its tool calls and its closing end-of-turn token.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

from megatron_agent.data.tasks import read_rows
from megatron_agent.errors import InputError

logger = logging.getLogger(__name__)
_ROLES = ("system", "user", "assistant", "tool")

QUICKSTART_TOOL_USE_RATE = 0.3
"""Share of quickstart demos that call the calculator; the rest guess (see quickstart_sft_data)."""
QUICKSTART_MAX_DEPTH = 1
"""Expression depth of the quickstart's tasks and demos: `a op b`, operands 1..99."""


# --------------------------------------------------------------------------------- rows
def _maybe_json(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in ("[", "{"):
        return json.loads(value)
    return value


def parse_sft_row(row: Any) -> dict:
    """The normalised row {"messages": [...], "tools": [...] or None}; ValueError saying what is wrong."""
    if not isinstance(row, dict):
        raise ValueError("the row is not an object")
    messages = _maybe_json(row.get("messages"))
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of chat messages")
    clean = []
    for i, msg in enumerate(messages):
        msg = _maybe_json(msg)
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise ValueError(f"message {i} needs a role in {_ROLES}, got {msg!r:.80}")
        calls = _maybe_json(msg.get("tool_calls")) or None
        content = msg.get("content")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"message {i} ({msg['role']}) needs string content")
        if calls is not None:
            if msg["role"] != "assistant" or not isinstance(calls, list):
                raise ValueError(f"message {i}: 'tool_calls' must be a list on an assistant message")
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"message {i}: each tool call needs function.name")
                if "arguments" in fn:
                    fn["arguments"] = _maybe_json(fn["arguments"])
        out = {"role": msg["role"], "content": content}
        if calls:
            out["tool_calls"] = calls
        clean.append(out)
    if clean[0]["role"] == "assistant":
        raise ValueError("the conversation starts with an assistant message (nothing to condition on)")
    if not any(m["role"] == "assistant" for m in clean):
        raise ValueError("no assistant message: nothing to train on")
    tools = _maybe_json(row.get("tools")) or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("'tools' must be a list of JSON tool schemas (objects)")
    return {"messages": clean, "tools": tools}


def load_sft_rows(path: str | os.PathLike) -> tuple[list[dict], int]:
    """Rows of a .jsonl or .parquet SFT file and the number of bad rows skipped (each warned about)."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise InputError(f"{path}: SFT files are .jsonl or .parquet")
    if not path.is_file():
        raise InputError(f"SFT file {path} does not exist")
    rows, num_skipped = [], 0
    for num, row, error in read_rows(path):
        try:
            if error:
                raise ValueError(error)
            rows.append(parse_sft_row(row))
        except (ValueError, TypeError, AttributeError) as exc:
            logger.warning("%s: row %d skipped: %s", path, num, exc)
            num_skipped += 1
    return rows, num_skipped


def write_sft_rows(path: str | os.PathLike, rows: list[dict]) -> Path:
    """Write rows as jsonl (or parquet when the name ends in .parquet, nested fields as JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        flat = [{k: None if v is None else json.dumps(v) for k, v in r.items()} for r in rows]
        pq.write_table(pa.Table.from_pylist(flat), path)
    else:
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return path


# --------------------------------------------------------------------------------- tokens
def _template_ids(tokenizer, messages, tools, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def _extend(ids: list[int], longer: list[int], what: str) -> list[int]:
    """The ids `longer` adds after `ids`; ValueError when `ids` is not its prefix."""
    if longer[: len(ids)] != ids:
        at = next((k for k, (a, b) in enumerate(zip(ids, longer)) if a != b), min(len(ids), len(longer)))
        raise ValueError(
            f"the chat template's ids for {what} do not extend the previous turns' ids (first "
            f"difference at token {at}): the template rewrites earlier turns (e.g. it drops past "
            "reasoning), so a turn-by-turn mask cannot be built; use a template that renders "
            "earlier turns unchanged"
        )
    return longer[len(ids) :]


def tokenize_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None
) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a conversation, both of length len(ids).

    `ids` equal `tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)`. The mask is
    1 on each assistant turn's content, tool calls and closing EOS (`<|im_end|>`), 0 on system,
    user and tool turns, on the template's assistant header (`<|im_start|>assistant\\n`) and on
    template text after the EOS. Raises ValueError when the template rewrites earlier turns or
    an assistant turn has no EOS.
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token: the end of an assistant turn cannot be marked")
    ids: list[int] = []
    mask: list[int] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("the conversation starts with an assistant message")
        header = _template_ids(tokenizer, messages[:i], tools, add_generation_prompt=True)
        new = _extend(ids, header, f"the generation prompt of message {i}")
        ids += new
        mask += [0] * len(new)
        turn = _extend(ids, _template_ids(tokenizer, messages[: i + 1], tools, False), f"message {i}")
        if eos_id not in turn:
            raise ValueError(f"assistant message {i} is not closed by the EOS token {tokenizer.eos_token!r}")
        last_eos = len(turn) - 1 - turn[::-1].index(eos_id)
        ids += turn
        mask += [1] * (last_eos + 1) + [0] * (len(turn) - last_eos - 1)
    rest = _extend(ids, _template_ids(tokenizer, messages, tools, False), "the whole conversation")
    ids += rest
    mask += [0] * len(rest)
    return ids, mask


def tokenize_rows(
    tokenizer, rows: list[dict], *, max_length: int = 0
) -> tuple[list[list[int]], list[list[int]], int]:
    """(ids, loss masks, number skipped) of parsed rows.

    A row is skipped (warned about and counted) when its template breaks the turn-by-turn build,
    when it has no loss token, or when it is longer than `max_length` tokens (0: no limit).
    """
    all_ids, all_masks, num_skipped = [], [], 0
    for k, row in enumerate(rows):
        try:
            ids, mask = tokenize_conversation(tokenizer, row["messages"], row.get("tools"))
            if max_length and len(ids) > max_length:
                raise ValueError(f"{len(ids)} tokens, more than max_length={max_length}")
            if not any(mask[1:]):
                raise ValueError("no assistant token carries loss")
        except ValueError as exc:
            logger.warning("SFT row %d skipped: %s", k, exc)
            num_skipped += 1
            continue
        all_ids.append(ids)
        all_masks.append(mask)
    return all_ids, all_masks, num_skipped


# --------------------------------------------------------------------------------- synthetic
def calculator_call(expression: str) -> str:
    """The assistant text of one calculator call, in the form the agent loop parses."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>{body}</tool_call>"


def expression_of(question: str) -> str:
    """The expression of an `arithmetic_tasks` question ("What is 12 + 7?" -> "12 + 7")."""
    return question.removeprefix("What is ").removesuffix("?")


def synthetic_calculator_demos(
    num: int, seed: int, tool_use_rate: float = QUICKSTART_TOOL_USE_RATE, max_depth: int = 1
) -> list[dict]:
    """`num` demonstration rows for the arithmetic tasks of `data.synthetic.arithmetic_tasks`.

    The same system prompt, question and calculator schema as the RL tasks. A share
    `tool_use_rate` of the rows calls the calculator and answers with its result; the rest answer
    at once with a guess: the expression's first number (almost always wrong). Both kinds copy
    digits from the question, so the copying that tool use needs is learned from every row.
    """
    from megatron_agent.data.synthetic import arithmetic_tasks
    from megatron_agent.envs.tools.calculator import Calculator

    if not 0.0 <= tool_use_rate <= 1.0:
        raise ValueError(f"tool_use_rate={tool_use_rate} must be in [0, 1]")
    schema = Calculator().schema()
    rng = random.Random(f"sft-demos-{seed}")
    rows = []
    for task in arithmetic_tasks(num, seed=seed, max_depth=max_depth):
        answer = task.reward["ground_truth"]
        messages = [dict(m) for m in task.messages]
        if rng.random() < tool_use_rate:
            expression = expression_of(messages[-1]["content"])
            messages += [
                {"role": "assistant", "content": calculator_call(expression)},
                {"role": "tool", "content": answer},
                {"role": "assistant", "content": f"<answer>{answer}</answer>"},
            ]
        else:
            guess = re.search(r"\d+", expression_of(messages[-1]["content"])).group(0)
            messages.append({"role": "assistant", "content": f"<answer>{guess}</answer>"})
        rows.append({"messages": messages, "tools": [schema]})
    return rows


def quickstart_sft_data(
    num: int = 2000, seed: int = 0, tool_use_rate: float = QUICKSTART_TOOL_USE_RATE
) -> list[dict]:
    """The quickstart's SFT rows: calculator demos of `a op b` questions, some calling the tool.

    With tool_use_rate < 0.5 the SFT'd model calls the calculator on about that share of sampled
    answers but, greedily, guesses: RL rewarded for correct answers learns to always call it.
    Use a `seed` different from the RL and validation task seeds.
    """
    return synthetic_calculator_demos(num, seed + 100_003, tool_use_rate, QUICKSTART_MAX_DEPTH)
