"""Write a tiny HF model and chat-formatted token ids to score (the pre-trainer quickstart)."""

import json
import sys
from pathlib import Path

from megatron_agent.models.tiny import make_tiny_model

QUESTIONS = [
    "What is 12 + 7?",
    "What is 3 * (4 + 5)?",
    "Which city is the capital of Zorbia?",
    "What is 100 / 4?",
]


def main(run_dir: str) -> None:
    run = Path(run_dir)
    model = make_tiny_model(run / "model", "qwen2")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    with open(run / "score_in.jsonl", "w") as f:
        for q in QUESTIONS:
            messages = [
                {"role": "user", "content": q},
                {"role": "assistant", "content": "<answer>19</answer>"},
            ]
            ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            f.write(json.dumps({"input_ids": ids}) + "\n")
    print(f"model: {model}\ninputs: {run / 'score_in.jsonl'}")


if __name__ == "__main__":
    main(sys.argv[1])
