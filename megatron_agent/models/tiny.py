"""Tiny random HF models with a locally built tokenizer, for tests, benchmarks and the quickstart.

Nothing is downloaded: the byte-level BPE tokenizer is trained here on a small built-in corpus and
the weights are random. The folders look exactly like real HF checkpoints (config.json,
model.safetensors, tokenizer files, a Qwen2.5-style chat template with tool calls), so every code
path that reads a real model reads these the same way.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")
TOKENIZER_SIZE = 330  # entries in the tiny tokenizer (bytes, merges, added tokens)

# Added tokens shared by every tiny tokenizer. Tool tags are added with special=False so that
# they stay in decoded text (vLLM's stop strings match on text).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TEXT_TAGS = ["<answer>", "</answer>", "<think>", "</think>"]

# A Qwen2.5-style template: system/user/assistant/tool turns, tool calls as
# <tool_call>{json}</tool_call>, tool results wrapped in a user turn as <tool_response>.
CHAT_TEMPLATE = """\
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] -}}{%- else -%}{{- 'You are a helpful assistant.' -}}{%- endif -%}
{{- '\n\n# Tools\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n' -}}
{%- elif messages[0]['role'] == 'system' -%}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- elif message['role'] == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') -}}
{%- for call in message.get('tool_calls') or [] -%}
{{- '<tool_call>{"name": "' + call['function']['name'] + '", "arguments": ' + (call['function']['arguments'] | tojson) + '}</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 7? Use the calculator. The answer is 19.",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "capital of Zorbia"}}</tool_call>',
    "<tool_response>\n27\n</tool_response> <answer>27</answer>",
    "You are a helpful assistant. system user assistant tool",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / ( ) = . , : ; ? ! \" ' { } [ ]",
    "Which city is the capital of the country where the river flows? Search the corpus.",
    "def add(a, b):\n    return a + b\nprint(add(2, 3))",
]


def build_tokenizer(out_dir: str | os.PathLike, *, vocab_size: int = TOKENIZER_SIZE):
    """Train a byte-level BPE tokenizer on the built-in corpus and save it as an HF fast tokenizer.

    Returns the `PreTrainedTokenizerFast`. The vocabulary has exactly `vocab_size` entries
    (including the added tokens) when the corpus allows that many merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _train_and_save(tok, _CORPUS * 4, vocab_size, out_dir)


def _train_and_save(tok, corpus: list[str], vocab_size: int, out_dir: str | os.PathLike):
    """Train BPE `tok` on `corpus` to `vocab_size` entries (added tokens included), add our
    special tokens, tool tags and chat template, and save it as an HF fast tokenizer."""
    from tokenizers import AddedToken, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    num_added = len(SPECIAL_TOKENS) + len(TOOL_TAGS) + len(TEXT_TAGS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS + TEXT_TAGS])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def tiny_config(family: str, *, vocab_size: int, tied: bool = False, **overrides) -> dict:
    """The HF config.json dictionary of a tiny model of `family` (llama, qwen2 or qwen3).

    Sizes respect vLLM's CPU attention kernel (head_dim 32 or 64). Qwen3 gets head_dim 64 with
    hidden 128 and 4 heads, so head_dim != hidden / heads; every family uses GQA (4 q heads, 2 kv).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {FAMILIES}")
    base = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=vocab_size,
        tie_word_embeddings=tied,
        hidden_act="silu",
        initializer_range=0.05,
        bos_token_id=None,
        eos_token_id=None,
        torch_dtype="float32",
    )
    if family == "llama":
        base.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            attention_bias=False,
            mlp_bias=False,
            head_dim=32,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif family == "qwen2":
        base.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
    else:
        base.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            head_dim=64,
            attention_bias=False,
            use_sliding_window=False,
        )
    base.update(overrides)
    return base


def make_tiny_model(
    out_dir: str | os.PathLike,
    family: str = "qwen2",
    *,
    tied: bool = False,
    vocab_size: int = 400,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> Path:
    """Write a random tiny HF model (config, safetensors, tokenizer, chat template) to `out_dir`.

    `vocab_size` is the model's embedding rows, at least the tokenizer's size (like real Qwen
    checkpoints, the embedding may have more rows than the tokenizer). The default 400 is
    deliberately not a multiple of 128 * TP. Returns the folder.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if vocab_size < TOKENIZER_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tiny tokenizer ({TOKENIZER_SIZE})")
    tokenizer = build_tokenizer(out)
    cfg_dict = tiny_config(family, vocab_size=vocab_size, tied=tied, **config_overrides)
    cfg_dict["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg_dict["pad_token_id"] = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random but well-scaled weights: norms near one (not exactly one) so q/k norms and layer
    # norms are exercised by the comparisons.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    model = model.to(dtype)
    model.save_pretrained(str(out), safe_serialization=True)
    with open(out / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": cfg_dict["eos_token_id"], "do_sample": True}, f)
    return out


# --------------------------------------------------------------------------------- quickstart
QUICKSTART_VOCAB_SIZE = 640  # embedding rows of the quickstart model; its tokenizer has ~530 entries


def _quickstart_corpus(num: int = 600) -> list[str]:
    """Rendered calculator conversations, so that merges cover the template and tool schema."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from megatron_agent.data.sft import synthetic_calculator_demos

    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    renderer.chat_template = CHAT_TEMPLATE
    # Added tokens split the text before BPE runs: train on the pieces between them only.
    added = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TAGS + TEXT_TAGS))
    pieces = []
    for row in synthetic_calculator_demos(num, seed=987_654, tool_use_rate=0.5):
        text = renderer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
        pieces += [p for p in added.split(text) if p]
    return pieces


def build_quickstart_tokenizer(out_dir: str | os.PathLike, *, vocab_size: int = QUICKSTART_VOCAB_SIZE):
    """A byte-level BPE tokenizer for the calculator quickstart, saved as an HF fast tokenizer.

    Every digit is a token of its own (numbers are copied digit by digit from the question into
    the tool call and from the tool response into the answer) and every newline too; merges may
    cross spaces and are learned on rendered calculator conversations, so the system prompt and
    the tool schema take a few tokens. Since the agent loop joins template pieces and tool output
    at newlines, its ids equal those of the whole rendered conversation. Same added tokens and
    chat template as `build_tokenizer`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return _train_and_save(tok, _quickstart_corpus(), vocab_size, out_dir)


def make_quickstart_model(out_dir: str | os.PathLike, seed: int = 0, **config_overrides) -> Path:
    """Write the quickstart's random Llama model (hidden 128, 4 heads of 32, 4 layers) to `out_dir`.

    Its tokenizer is `build_quickstart_tokenizer`'s (digits as single tokens). Random weights:
    SFT on `data.sft.quickstart_sft_data` first. Returns the folder.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_quickstart_tokenizer(out)
    if len(tokenizer) > QUICKSTART_VOCAB_SIZE:
        raise AssertionError(f"quickstart tokenizer has {len(tokenizer)} entries > {QUICKSTART_VOCAB_SIZE}")
    # Llama, not Qwen2: transformers 5 loads every qwen2 folder with Qwen2Tokenizer, which
    # replaces this tokenizer's pre-tokenizer with its own (vLLM would then tokenize otherwise).
    cfg_dict = tiny_config(
        "llama", vocab_size=QUICKSTART_VOCAB_SIZE, intermediate_size=384, rope_scaling=None
    )
    cfg_dict.update(config_overrides)
    cfg_dict["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg_dict["pad_token_id"] = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model_type = cfg_dict.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **cfg_dict), dtype=torch.float32
    )
    model.save_pretrained(str(out), safe_serialization=True)
    with open(out / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": cfg_dict["eos_token_id"], "do_sample": True}, f)
    return out
