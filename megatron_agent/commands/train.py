"""`python -m megatron_agent train --config FILE key=value ...`: RL training of a tool-calling agent.

Starts (or joins, `ray.address`) a Ray cluster, the Megatron world (actor + reference) and the
rollout engines; runs SFT first when `sft.steps > 0` and no `trainer.init_from` is given; syncs
the actor's weights into the engines; validates; then runs `trainer.total_steps` RL steps,
validating every `trainer.test_freq` steps and after the last one. The run itself is
`megatron_agent.train.run.Run`; this module parses arguments and returns its exit status.
"""

from __future__ import annotations

import argparse
import logging


def parse_args(prog: str, argv: list[str], doc: str) -> argparse.Namespace:
    """--config FILE plus key=value overrides."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=5")
    return parser.parse_args(argv)


def load(prog: str, argv: list[str], doc: str):
    """The loaded config (a bad one raises `ConfigError`, which `run_command` reports: exit 2)."""
    from megatron_agent.config import load_config

    args = parse_args(prog, argv, doc)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("ray", "vllm", "transformers", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return load_config(args.config, args.overrides)


def main(argv: list[str]) -> int:
    """Run the train command; returns the exit status."""
    from megatron_agent.train.run import Run

    return Run(load("python -m megatron_agent train", argv, __doc__)).train()
