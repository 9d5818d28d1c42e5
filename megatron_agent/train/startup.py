"""What a run's start-up spent its time on, from the process's start to its first step.

`StartupClock` records phases as the run passes through them (`phase(name)` around a block, or
`add(name, seconds)` for phases that ran concurrently, as the Megatron ranks and the engines
do), and gives them as `timing_s/startup/<phase>` metrics (logged with step 0) and as one line
in the log:

    start-up: 19.6 s to the first step (inputs 2.2 [ray 3.1 in the background], wait_ray 0.9,
    workers 11.2 [megatron 5.7 | engines 11.2, concurrently], first_sync 0.2, validation 0.3)

`total` counts from the process's start (`process_age`), so interpreter start-up and
imports are in it: the time a user waits.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from megatron_agent.platform.run_token import start_ticks

# Phases that ran at the same time as another (shown in brackets after it): Ray starts while the
# driver reads its inputs; the Megatron ranks, a separate critic's and the engines start together
# ("workers").
CONCURRENT = {"inputs": ("ray",), "workers": ("megatron", "critic", "engines")}


def process_age() -> float:
    """Seconds since this process started, to 10 ms: /proc/uptime minus the start's clock ticks
    (`run_token.start_ticks`), both counted from the same boot. psutil's `create_time()` only where
    /proc has neither: it adds the start's clock ticks to the boot time that Linux gives in whole
    seconds (/proc/stat's btime, rounded down), so it is up to 1 s early (0.6 s on the machine
    where this was found, which made every start-up look that much longer)."""
    ticks = start_ticks(os.getpid())
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        uptime = None
    if ticks is None or uptime is None:
        return time.time() - psutil.Process().create_time()
    return uptime - int(ticks) / os.sysconf("SC_CLK_TCK")


class StartupClock:
    """Start-up phases of one run, in the order they happened."""

    def __init__(self):
        # The process's start on the perf_counter clock: a step of the wall clock while the run
        # starts (NTP, a virtual machine resumed) must not count as start-up time.
        self.origin = time.perf_counter() - process_age()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (added to it when the phase repeats)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Record `seconds` of phase `name` (added to what it has)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def total(self) -> float:
        """Seconds from the process's start until now."""
        return time.perf_counter() - self.origin

    def metrics(self) -> dict[str, float]:
        """`timing_s/startup/<phase>` for every phase, and `timing_s/startup/total` (until now)."""
        out = {f"timing_s/startup/{name}": s for name, s in self.seconds.items()}
        out["timing_s/startup/total"] = self.total()
        return out

    def line(self) -> str:
        """The start-up in one line: the total, then each phase (concurrent ones in brackets)."""
        inner = {n for names in CONCURRENT.values() for n in names}
        parts = []
        for name, s in self.seconds.items():
            if name in inner:
                continue
            part = f"{name} {s:.1f}"
            together = [f"{n} {self.seconds[n]:.1f}" for n in CONCURRENT.get(name, ()) if n in self.seconds]
            if len(together) == 1:
                part += f" [{together[0]} in the background]"
            elif together:
                part += f" [{' | '.join(together)}, concurrently]"
            parts.append(part)
        return f"start-up: {self.total():.1f} s to the first step ({', '.join(parts)})"
