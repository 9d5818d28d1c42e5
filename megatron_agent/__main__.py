"""`python -m megatron_agent COMMAND ...` (also the `megatron-agent` console script)."""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

# command -> module with a `main(argv: list[str]) -> int` function. Imported lazily so that
# `--help` and light commands do not pay for torch, megatron or vllm imports.
COMMANDS = {
    "train": ("megatron_agent.commands.train", "RL training (GRPO, REINFORCE++, RLOO, ...) on Ray"),
    "sft": ("megatron_agent.commands.sft", "supervised warm start on chat data with tool calls"),
    "score": ("megatron_agent.commands.score", "per-token log-probs of token ids with Megatron"),
    "rollout": ("megatron_agent.commands.rollout", "run the agent loop on a dataset and dump rollouts"),
    "check-sandbox": (
        "megatron_agent.commands.check_sandbox",
        "whether the python tool's sandbox holds here",
    ),
}


def _usage() -> str:
    lines = ["usage: python -m megatron_agent COMMAND [args...] [--debug]", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "--debug: print the traceback of an expected error (bad input: exit 2; run failure: 1)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the sub-command named by the first argument."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from megatron_agent.errors import run_command

    module = importlib.import_module(COMMANDS[name][0])
    return run_command(module.main, rest)


def cli() -> NoReturn:
    """The console script and `python -m megatron_agent`: `main`'s status, with the process
    ended without the interpreter's teardown (`platform.fast_exit`: 1.5 s after a run's last
    line)."""
    from megatron_agent.platform.fast_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    cli()
