"""The two kinds of expected error, and the one handler every command runs under.

- `InputError` (exit status 2): the user's input is wrong: a config value, a data file, a model
  folder, a checkpoint, a layout. Raised before anything starts (Ray, torchrun, vLLM, a worker).
- `RunFailure` (exit status 1): something failed while the run ran: a worker died, a save or a
  weight sync failed, the guard stopped the run.

`run_command(main, argv)` runs a command's `main` and turns either kind into one line
`error: ...` on stderr and its exit status; any other exception is a bug and keeps its
traceback. `--debug` (or MEGATRON_AGENT_DEBUG=1) prints the traceback of expected errors too.
Also the input checks shared by the commands and the converters (flags >= 1, the torchrun
world). This module imports nothing heavy: every command and converter starts with it.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence

DEBUG_FLAG = "--debug"


class InputError(ValueError):
    """The user's input is wrong; the message names the input and, where it helps, the fix."""

    exit_status = 2


class RunFailure(RuntimeError):
    """The run failed while it ran (a worker, a save, a sync); the message names what failed."""

    exit_status = 1


def check_positive(flags: dict[str, int]) -> None:
    """Raise one `InputError` naming every flag (e.g. {'--tp': -1}) whose value is below 1."""
    bad = [f"{flag} {value}" for flag, value in flags.items() if value < 1]
    if bad:
        raise InputError(f"{', '.join(bad)}: must be >= 1")


def check_world_size(flags: str, model_parallel: int, relaunch: str) -> None:
    """Raise `InputError` when tp*pp (`model_parallel`, given as `flags`) does not divide
    torchrun's WORLD_SIZE (1 without torchrun); the message gives the `relaunch` command line."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % model_parallel:
        launched = "one process (no torchrun)" if world == 1 else f"{world} torchrun processes"
        raise InputError(
            f"{flags} need a multiple of tp*pp={model_parallel} processes, but this is {launched}. "
            f"Run: {relaunch}"
        )


def _is_main_rank() -> bool:
    """True outside torchrun and on its rank 0 (so that an error is printed once)."""
    return os.environ.get("RANK", "0") == "0"


def debug_enabled() -> bool:
    """True with `--debug` (run_command sets MEGATRON_AGENT_DEBUG=1) or that variable set."""
    return os.environ.get("MEGATRON_AGENT_DEBUG") == "1"


def report(exc: BaseException, status: int | None = None) -> int:
    """Print `error: exc` (its traceback first with --debug) and return the exit status: `status`,
    else the error's own (2 for an `InputError`, 1 otherwise)."""
    if debug_enabled():
        traceback.print_exception(exc)
    if _is_main_rank():
        print(f"error: {exc}", file=sys.stderr)
    return status if status is not None else getattr(exc, "exit_status", 1)


def run_command(main: Callable[[list[str]], int | None], argv: Sequence[str]) -> int:
    """`main(argv)`'s exit status; an `InputError` or `RunFailure` becomes one message and its status."""
    argv = list(argv)
    if DEBUG_FLAG in argv:
        os.environ["MEGATRON_AGENT_DEBUG"] = "1"  # also seen by code that reports errors itself
        argv = [a for a in argv if a != DEBUG_FLAG]
    try:
        return int(main(argv) or 0)
    except (InputError, RunFailure) as exc:
        return report(exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
