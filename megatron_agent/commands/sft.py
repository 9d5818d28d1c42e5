"""`python -m megatron_agent sft --config FILE key=value ...`: supervised warm start on chat data.

Masked NLL on the assistant tokens of `sft.data_path` (jsonl or parquet of chat messages with
tool calls; synthetic calculator demonstrations when empty) for `sft.steps` steps on the same
Megatron workers as `train`, then an atomic checkpoint in `<trainer.run_dir>/sft/checkpoint`
that `train` starts from with `trainer.init_from=PATH`.
"""

from __future__ import annotations

import sys

from megatron_agent.commands.train import load, make_trainer


def main(argv: list[str]) -> int:
    """Run the sft command; returns the exit status."""
    cfg, status = load("python -m megatron_agent sft", argv, __doc__)
    if cfg is None:
        return status
    if cfg.sft.steps < 1:
        print("error: sft.steps must be >= 1 for the sft command (e.g. sft.steps=200)", file=sys.stderr)
        return 2
    trainer, status = make_trainer(cfg)
    if trainer is None:
        return status
    from megatron_agent.config import config_to_dict
    from megatron_agent.train.cluster import WorkerError
    from megatron_agent.train.run_log import RunLogger
    from megatron_agent.train.sft_run import run_sft

    run_log = RunLogger(trainer.run_dir, cfg.logging, config_dict=config_to_dict(cfg))
    try:
        trainer.start(engines=False)
        ckpt = run_sft(trainer, run_log, trainer.run_dir / "sft" / "checkpoint")
        print(f"SFT checkpoint: {ckpt}\nstart RL from it with: trainer.init_from={ckpt}")
        return 0
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        run_log.close()
        trainer.close()
