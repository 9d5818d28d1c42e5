"""`python -m megatron_agent sft --config FILE key=value ...`: supervised warm start on chat data.

Masked NLL on the assistant tokens of `sft.data_path` (jsonl or parquet of chat messages with
tool calls; synthetic calculator demonstrations when empty) for `sft.steps` steps on the same
Megatron workers as `train`, then an atomic checkpoint in `<trainer.run_dir>/sft/checkpoint`
that `train` starts from with `trainer.init_from=PATH`.
"""

from __future__ import annotations

from megatron_agent.commands.train import load
from megatron_agent.config import ConfigError


def main(argv: list[str]) -> int:
    """Run the sft command; returns the exit status."""
    from megatron_agent.train.run import Run

    cfg = load("python -m megatron_agent sft", argv, __doc__)
    if cfg.sft.steps < 1:
        raise ConfigError("sft.steps must be >= 1 for the sft command (e.g. sft.steps=200)")
    return Run(cfg).sft()
