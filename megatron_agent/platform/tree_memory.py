"""The memory of a run's process tree: the driver and every process below it, sampled on a thread.

On one node every process of a run descends from its driver: Ray's GCS and raylet (a local
cluster), the Megatron ranks and rollout engines (children of the raylet), the tools' sandboxes
and the reaper. `TreeMemory` sums their resident set sizes every `interval_s` and keeps the
peak: `perf/peak_rss_sum_gb`, the number a user compares with a single-process trainer (shared
library pages count once per process that maps them, as `ps` and `top` count them), and
`perf/peak_pss_sum_gb`, the proportional set size summed (shared pages split between the
processes sharing them: what the tree really takes from the machine). A joined multi-node
cluster's workers are not below the driver; there the figures cover this node's part only.

The two cost differently: a process's RSS is one short read (/proc/<pid>/statm, 0.1 ms), its PSS
a walk of all its page tables by the kernel (/proc/<pid>/smaps_rollup: 16-18 ms for an engine, a
Megatron rank or the driver on the quickstart). Read every second, the PSS kept 6% of a core busy
for the whole run. So the RSS is read at every sample, and the PSS only at the first, at each
sample that raises the RSS peak by 1% (where the tree is largest) and at least every `pss_interval_s`.
"""

from __future__ import annotations

import threading
import time

import psutil

NEW_PEAK = 1.01
"""An RSS sum above the peak so far by this factor has its PSS read (smaller rises: when due)."""


def pss_bytes(process: psutil.Process) -> int:
    """The proportional set size of `process` from /proc/<pid>/smaps_rollup (0 where unreadable)."""
    try:
        with open(f"/proc/{process.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_processes(root: psutil.Process | None = None) -> list[psutil.Process]:
    """`root` (default: this process) and its descendants."""
    root = root or psutil.Process()
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return [root]


def tree_rss(processes: list[psutil.Process]) -> tuple[int, list[psutil.Process]]:
    """(RSS summed, the processes read): those that ended meanwhile are left out."""
    rss, alive = 0, []
    for process in processes:
        try:
            rss += process.memory_info().rss
        except psutil.Error:
            continue
        alive.append(process)
    return rss, alive


def tree_pss(processes: list[psutil.Process]) -> int:
    """PSS summed over `processes` (the costly read: a page-table walk each)."""
    return sum(pss_bytes(p) for p in processes)


def tree_usage(root: psutil.Process | None = None) -> tuple[int, int, int]:
    """(RSS summed, PSS summed, number of processes) of `root` (default: this process) and its
    descendants; processes that end while being read are left out."""
    rss, alive = tree_rss(tree_processes(root))
    return rss, tree_pss(alive), len(alive)


class TreeMemory:
    """Samples the tree every `interval_s` on a daemon thread; `metrics()` gives the peaks. The
    PSS is read at the first sample, at every new RSS peak, at least every `pss_interval_s` and
    at the last sample (`stop`)."""

    def __init__(self, interval_s: float = 1.0, pss_interval_s: float = 10.0):
        self.interval_s, self.pss_interval_s = interval_s, pss_interval_s
        self.peak_rss = self.peak_pss = self.peak_processes = 0
        self.num_samples = self.num_pss_reads = 0
        self._last_pss_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def start(self) -> TreeMemory:
        """Start sampling (the first sample is taken at once)."""
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        """Stop sampling, after one last sample; returns `metrics()`."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        return self.metrics()

    def sample(self, pss: bool = False) -> None:
        """Read the tree once and raise the peaks; the PSS too when `pss`, or when it is due."""
        rss, alive = tree_rss(tree_processes())
        now = time.monotonic()
        pss = (
            pss
            or rss > self.peak_rss * NEW_PEAK
            or self._last_pss_at is None
            or now - self._last_pss_at >= self.pss_interval_s
        )
        self.num_samples += 1
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_processes = max(self.peak_processes, len(alive))
        if pss:
            self.peak_pss = max(self.peak_pss, tree_pss(alive))
            self.num_pss_reads += 1
            self._last_pss_at = now

    def metrics(self) -> dict[str, float]:
        """`perf/peak_rss_sum_gb`, `perf/peak_pss_sum_gb` and `perf/peak_processes` so far."""
        return {
            "perf/peak_rss_sum_gb": self.peak_rss / 1e9,
            "perf/peak_pss_sum_gb": self.peak_pss / 1e9,
            "perf/peak_processes": float(self.peak_processes),
        }

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                self.sample(pss=True)
                return
