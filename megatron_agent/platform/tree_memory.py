"""The memory of a run's process tree: the driver and every process below it, sampled on a thread.

On one node every process of a run descends from its driver: Ray's GCS and raylet (a local
cluster), the Megatron ranks and rollout engines (children of the raylet), the tools' sandboxes
and the reaper. `TreeMemory` sums their resident set sizes every `interval_s` and keeps the
peak: `perf/peak_rss_sum_gb`, the number a user compares with a single-process trainer (shared
library pages count once per process that maps them, as `ps` and `top` count them), and
`perf/peak_pss_sum_gb`, the proportional set size summed (shared pages split between the
processes sharing them: what the tree really takes from the machine). A joined multi-node
cluster's workers are not below the driver; there the figures cover this node's part only.
"""

from __future__ import annotations

import threading

import psutil


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


def tree_usage(root: psutil.Process | None = None) -> tuple[int, int, int]:
    """(RSS summed, PSS summed, number of processes) of `root` (default: this process) and its
    descendants; processes that end while being read are left out."""
    root = root or psutil.Process()
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        processes = [root]
    rss = pss = count = 0
    for process in processes:
        try:
            rss += process.memory_info().rss
        except psutil.Error:
            continue
        pss += pss_bytes(process)
        count += 1
    return rss, pss, count


class TreeMemory:
    """Samples `tree_usage` every `interval_s` on a daemon thread; `metrics()` gives the peaks."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.peak_rss = self.peak_pss = self.peak_processes = 0
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

    def sample(self) -> None:
        """Read the tree once and raise the peaks."""
        rss, pss, count = tree_usage()
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.peak_processes = max(self.peak_processes, count)

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
                self.sample()
                return
