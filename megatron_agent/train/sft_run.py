"""The driver side of SFT: tokenize the chat data, step the Megatron workers, save a checkpoint.

Runs on the same workers as RL (`Trainer.actors`). The masks come from the chat template's token
ids turn by turn (`data.sft.tokenize_conversation`); the loss is a masked NLL normalised by the
global count of assistant tokens (`train.sft.sft_step`). The result is an atomic checkpoint that
`train` starts from (`trainer.init_from`, or directly when SFT runs inside `train`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

logger = logging.getLogger("megatron_agent.sft")


def sft_examples(t) -> tuple[list[list[int]], list[list[int]], int]:
    """(ids, loss masks, number of rows skipped) of the SFT data of `t.cfg.sft`."""
    from megatron_agent.data.sft import load_sft_rows, synthetic_calculator_demos, tokenize_conversation

    s = t.cfg.sft
    if s.data_path:
        rows, num_skipped = load_sft_rows(s.data_path)
    else:
        rows = synthetic_calculator_demos(
            s.num_synthetic, s.seed, tool_use_rate=s.tool_use_rate, max_depth=t.cfg.data.arithmetic_max_depth
        )
        num_skipped = 0
    sequences, masks = [], []
    for row in rows:
        ids, mask = tokenize_conversation(t.tokenizer, row["messages"], row.get("tools"))
        if len(ids) > t.cfg.rollout.max_total_tokens or sum(mask) == 0:
            num_skipped += 1
            continue
        sequences.append(ids)
        masks.append(mask)
    if not sequences:
        raise ValueError(
            f"no usable SFT rows in {s.data_path or 'the synthetic demonstrations'} ({num_skipped} skipped)"
        )
    return sequences, masks, num_skipped


def run_sft(t, log, out_dir: str | Path) -> Path:
    """`sft.steps` optimizer steps (warmup, then cosine decay), logged as steps -N..-1; returns the checkpoint."""
    from megatron_agent.train.sft import lr_at, sft_batches

    s = t.cfg.sft
    sequences, masks, num_skipped = sft_examples(t)
    logger.info(
        "SFT on %d conversations (%d rows skipped) for %d steps", len(sequences), num_skipped, s.steps
    )
    for step in range(s.steps):
        chosen = sft_batches(len(sequences), s.batch_size, step, seed=s.seed)
        lr = lr_at(
            step, lr=s.lr, total_steps=s.steps, warmup_steps=s.warmup_steps, min_lr_ratio=s.min_lr_ratio
        )
        start = time.perf_counter()
        results = t.actors.call("sft_step", [sequences[i] for i in chosen], [masks[i] for i in chosen], lr)
        metrics = next(r for r in results if r is not None)
        metrics["timing_s/step"] = time.perf_counter() - start
        metrics["data/skipped_rows"] = float(num_skipped)
        log.log(step - s.steps, metrics)
    out = Path(out_dir)
    t.actors.call("save_checkpoint", str(out), t.model_path, {"sft_steps": s.steps})
    return out
