"""SFT data: rows load (bad ones skipped and counted), ids equal the chat template's, masks
cover exactly the assistant turns, and the ids equal what the agent loop builds at rollout."""

from __future__ import annotations

import json

import pytest

from megatron_agent.data.sft import (
    calculator_call,
    load_sft_rows,
    parse_sft_row,
    quickstart_sft_data,
    synthetic_calculator_demos,
    tokenize_conversation,
    tokenize_rows,
    write_sft_rows,
)
from megatron_agent.envs.tools.calculator import Calculator, evaluate
from megatron_agent.rollout.tool_parser import parse_tool_calls
from megatron_agent.train.sft import lr_at, sft_batches

SCHEMA = Calculator().schema()
CONVERSATION = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 12 + 7 and 3 * 4?"},
    {"role": "assistant", "content": "Two calls. " + calculator_call("12 + 7") + calculator_call("3 * 4")},
    {"role": "tool", "content": "19"},
    {"role": "tool", "content": "12"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "19 - 12"}}}],
    },
    {"role": "tool", "content": "7"},
    {"role": "assistant", "content": "<answer>7</answer>"},
    {"role": "user", "content": "Thanks. And -5?"},
    {"role": "assistant", "content": "<answer>-5</answer>"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from megatron_agent.models.tiny import build_quickstart_tokenizer, build_tokenizer

    root = tmp_path_factory.mktemp("sft_tok")
    return {"tiny": build_tokenizer(root / "tiny"), "quickstart": build_quickstart_tokenizer(root / "qs")}


def _template(tok, messages, tools=None, **kw):
    return tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **kw)


def _masked_spans(mask):
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.mark.parametrize("name", ["tiny", "quickstart"])
@pytest.mark.parametrize("tools", [None, [SCHEMA]])
def test_ids_equal_template_and_mask_is_assistant_only(tokenizers, name, tools):
    tok = tokenizers[name]
    ids, mask = tokenize_conversation(tok, CONVERSATION, tools)
    assert ids == _template(tok, CONVERSATION, tools)
    assert len(mask) == len(ids) and set(mask) == {0, 1}
    spans = _masked_spans(mask)
    assistants = [m for m in CONVERSATION if m["role"] == "assistant"]
    assert len(spans) == len(assistants)
    for (a, b), msg in zip(spans, assistants):
        text = tok.decode(ids[a:b], skip_special_tokens=False)
        calls = msg.get("tool_calls", [])
        body = msg["content"] + "".join(
            f'<tool_call>{{"name": "{c["function"]["name"]}", "arguments": '
            f"{json.dumps(c['function']['arguments'])}}}</tool_call>"
            for c in calls
        )
        assert text == body + "<|im_end|>"  # content and calls, closed by EOS, no header
        assert ids[b - 1] == tok.eos_token_id
        header = tok.decode(ids[:a], skip_special_tokens=False)
        assert header.endswith("<|im_start|>assistant\n")
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False)
    for msg in CONVERSATION:
        if msg["role"] != "assistant":
            assert msg["content"] in unmasked


def test_ids_equal_agent_loop_ids(tokenizers):
    """The quickstart demo's ids are those the agent loop builds (prompt, turns, tool turn)."""
    from megatron_agent.rollout.chat import ChatFormat

    tok = tokenizers["quickstart"]
    chat = ChatFormat(tok)
    row = next(
        r for r in synthetic_calculator_demos(20, seed=1, tool_use_rate=0.5) if len(r["messages"]) == 5
    )
    m = row["messages"]
    ids, mask = tokenize_conversation(tok, m, row["tools"])
    parts = chat.tool_turn(1).parts
    loop_ids = (
        chat.prompt_ids(m[:2], row["tools"])
        + chat.encode(m[2]["content"])  # what the model samples, stopped at </tool_call>
        + chat.closing_ids  # the injected EOS
        + parts[0]
        + chat.encode(m[3]["content"], plain=True)  # tool output
        + parts[1]
        + chat.encode(m[4]["content"])
        + [chat.eos_id]
    )
    assert ids[: len(loop_ids)] == loop_ids
    assert tok.decode(ids[len(loop_ids) :]) == "\n"  # the template's text after the last EOS
    assert mask[len(loop_ids) :] == [0]


def test_template_that_rewrites_history_is_refused(tokenizers, tmp_path):
    from megatron_agent.models.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path)
    # Like reasoning templates that drop earlier turns' content: the prefix property breaks.
    tok.chat_template = (
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\n' -}}"
        "{%- if m['role'] != 'assistant' or loop.last -%}{{- m['content'] -}}{%- endif -%}"
        "{{- '<|im_end|>\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    )
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        tokenize_conversation(tok, CONVERSATION[:2] + [CONVERSATION[7], CONVERSATION[8], CONVERSATION[9]])


def test_load_rows_skips_and_counts_bad_rows(tmp_path):
    good = {"messages": CONVERSATION[:2] + [CONVERSATION[7]], "tools": [SCHEMA]}
    lines = [
        json.dumps(good),
        "not json {",
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
        json.dumps(
            {"messages": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "u"}]}
        ),
        json.dumps({"messages": good["messages"], "tools": "calculator"}),
        "",
        json.dumps({"messages": good["messages"]}),
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows, skipped = load_sft_rows(path)
    assert (len(rows), skipped) == (2, 6)
    assert rows[0] == parse_sft_row(good) and rows[1]["tools"] is None
    pq = write_sft_rows(tmp_path / "sft.parquet", rows)
    assert load_sft_rows(pq) == (rows, 0)
    with pytest.raises(ValueError, match="does not exist"):
        load_sft_rows(tmp_path / "missing.jsonl")


def test_tokenize_rows_skips_too_long(tokenizers):
    rows = [parse_sft_row({"messages": CONVERSATION}), parse_sft_row({"messages": CONVERSATION[:3]})]
    ids, masks, skipped = tokenize_rows(
        tokenizers["quickstart"], rows, max_length=len(_template(tokenizers["quickstart"], CONVERSATION[:3]))
    )
    assert skipped == 1 and len(ids) == 1 and ids[0] == _template(tokenizers["quickstart"], CONVERSATION[:3])


@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_calculator_demos(rate):
    from megatron_agent.data.synthetic import ARITHMETIC_SYSTEM

    rows = synthetic_calculator_demos(400, seed=2, tool_use_rate=rate)
    with_tool = [r for r in rows if len(r["messages"]) == 5]
    assert abs(len(with_tool) / len(rows) - rate) < 0.06
    for r in rows:
        m = r["messages"]
        assert r["tools"] == [SCHEMA] and m[0] == {"role": "system", "content": ARITHMETIC_SYSTEM}
        assert m[1]["content"].startswith("What is ")
        assert [x["role"] for x in m[2:]] in (["assistant", "tool", "assistant"], ["assistant"])
    for r in with_tool:
        (call,) = parse_tool_calls(r["messages"][2]["content"])
        assert call.error is None and call.name == "calculator"
        value = str(evaluate(call.arguments["expression"]))
        assert r["messages"][3]["content"] == value
        assert r["messages"][4]["content"] == f"<answer>{value}</answer>"
    direct = [r for r in rows if len(r["messages"]) == 3]
    for r in direct:  # the guess: the first number of the question, almost never the value
        first = r["messages"][1]["content"].removeprefix("What is ").split()[0]
        assert r["messages"][2]["content"] == f"<answer>{first}</answer>"
    wrong = [
        r
        for r in direct
        if r["messages"][2]["content"] != f"<answer>{evaluate(r['messages'][1]['content'][8:-1])}</answer>"
    ]
    assert len(wrong) >= 0.95 * len(direct)
    assert quickstart_sft_data(10, seed=0) == quickstart_sft_data(10, seed=0)


def test_batches_resume_and_cover_each_epoch():
    seen = [k for step in range(5) for k in sft_batches(10, 4, step, seed=3)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert sft_batches(10, 4, 3, seed=3) == seen[12:16]
    assert lr_at(0, lr=1.0, total_steps=10, warmup_steps=2) == 0.5
    assert lr_at(2, lr=1.0, total_steps=10, warmup_steps=2) == 1.0
    assert lr_at(10, lr=1.0, total_steps=10, warmup_steps=2) == pytest.approx(0.1)
