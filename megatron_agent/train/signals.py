"""Graceful stop on SIGTERM / SIGUSR1 (what Slurm sends before a time limit or a preemption).

The first signal only sets a flag: the driver finishes the RL step it is in, saves a whole-run
checkpoint and exits 0 (`examples/slurm/ray_launch.sh` then requeues the job, which resumes with
`trainer.resume=auto`). A second signal stops at once: `ForcedStop` (a `SystemExit` with status
128 + signal number) is raised in the main thread, so `finally` blocks still stop the workers.
"""

from __future__ import annotations

import logging
import signal
import sys

logger = logging.getLogger("megatron_agent.train")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ForcedStop(SystemExit):
    """Raised by the second stop signal: exit now, without saving."""


class StopRequest:
    """Installs the handlers (main thread only); `requested` turns true at the first signal.

    Use as a context manager; the previous handlers come back on exit.
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = signals
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived."""
        return self.signum is not None

    @property
    def name(self) -> str:
        """The name of the first signal received ('' when none)."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            print(
                f"second {signal.Signals(signum).name}: stopping now, without a checkpoint", file=sys.stderr
            )
            raise ForcedStop(128 + signum)
        self.signum = signum
        print(
            f"{signal.Signals(signum).name} received: finishing the current step, then saving a "
            "checkpoint and exiting (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def install(self) -> None:
        """(Re)install the handlers: call again after `ray.init`, whose core worker replaces them."""
        for sig in self.signals:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
