"""The CPU cores a rollout engine and the Megatron ranks of its machine share in an async run.

In an async run on CPU the engines generate while the ranks update, on the same cores. A rank's
update runs OpenMP parallel regions on all its threads, and every region ends at a barrier: with
an engine busy on one of the cores, the rank's thread that shares it holds up the others at every
barrier, and their spinning there takes cycles the engine needed. So while an engine of the rank's
machine is generating, the rank runs on half its threads, and on all of them otherwise
(`async.share_cores`; measured in docs/async.md).

- `EngineActivity`, in the engine's process: one byte, 1 while the engine takes steps and 0 while it
  waits (for tools, an admission or a sync), in an anonymous memory file (`memfd_create`): nothing
  on disk, and it ends with the process.
- `ActivityWatch`, in a rank's process: the bytes of the engines on the rank's machine, mapped
  read-only through `/proc/<pid>/fd/<fd>`.
- `ThreadSharing`: hooks on the model's transformer layers that set torch's threads from the watch
  when each layer's forward and each layer's backward begins.

Not for deterministic runs (the threads of a reduction change its rounding, and here they follow
the engine's timing) nor on GPU, where the ranks compute on their devices.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MEMFD_NAME = "megatron_agent_engine_activity"


@dataclass(frozen=True)
class ActivityHandle:
    """Where a rank finds an engine's activity byte."""

    node: str
    """The machine of the engine (a Ray node id): only ranks on it share its cores."""
    pid: int
    fd: int


class EngineActivity:
    """The engine's side: whether it is generating now, in one shared byte."""

    def __init__(self, node: str):
        """`node`: this machine's id as the ranks know theirs (a Ray node id)."""
        self.node = node
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, 1)
        self._map = mmap.mmap(self.fd, 1)
        self._busy = False

    def set_busy(self, busy: bool) -> None:
        """Say whether the engine is taking steps (written only when it changes)."""
        if busy != self._busy:
            self._map[0] = 1 if busy else 0
            self._busy = busy

    def handle(self) -> ActivityHandle:
        """What a rank on this machine needs to watch this engine."""
        return ActivityHandle(self.node, os.getpid(), self.fd)

    def close(self) -> None:
        """Unmap and close the file (a rank that mapped it keeps its own mapping)."""
        self._map.close()
        os.close(self.fd)


class ActivityWatch:
    """The rank's side: whether any engine of this machine is generating now."""

    def __init__(self, handles: Iterable[ActivityHandle | None], node: str):
        """`handles`: every engine's `ActivityHandle` (None for an engine without one); those of
        other machines than `node` are left out. An engine whose byte cannot be
        opened (its process gone, a /proc that hides other processes) is left out with a warning."""
        self._maps: list[mmap.mmap] = []
        for h in handles:
            if h is None or h.node != node:
                continue
            try:
                path = f"/proc/{h.pid}/fd/{h.fd}"
                if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME}"):  # a pid or fd reused since
                    raise OSError(f"{path} is not an engine's activity byte")
                fd = os.open(path, os.O_RDONLY)
                try:
                    self._maps.append(mmap.mmap(fd, 1, prot=mmap.PROT_READ))
                finally:
                    os.close(fd)
            except OSError as exc:
                logger.warning("not sharing cores with the rollout engine of pid %d: %s", h.pid, exc)

    def __len__(self) -> int:
        return len(self._maps)

    def any_busy(self) -> bool:
        """True while any watched engine is taking steps."""
        return any(m[0] for m in self._maps)

    def close(self) -> None:
        """Unmap every byte."""
        for m in self._maps:
            m.close()
        self._maps = []


class ThreadSharing:
    """torch's intra-op threads of this process, `low` while a watched engine generates and
    `high` otherwise, set at the start of each hooked layer's forward and backward."""

    def __init__(self, watch: ActivityWatch, high: int):
        """`high`: the rank's own threads (its OMP_NUM_THREADS); `low` = half of them, at least 1."""
        import torch

        self._torch = torch
        self.watch, self.high, self.low = watch, high, max(1, high // 2)
        self._current = torch.get_num_threads()
        self._hooks: list = []
        self.checks = self.low_checks = 0

    def adjust(self, *_args) -> None:
        """Set the threads the engines' activity calls for now (a module pre-hook's signature)."""
        busy = self.watch.any_busy()
        self.checks += 1
        self.low_checks += busy
        threads = self.low if busy else self.high
        if threads != self._current:
            self._torch.set_num_threads(threads)
            self._current = threads

    def _after_forward(self, _module, _args, output) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if getattr(out, "requires_grad", False):  # its gradient arrives as the layer's backward begins
            out.register_hook(self._before_backward)

    def _before_backward(self, _grad) -> None:
        self.adjust()  # returns None: the gradient is unchanged

    def install(self, layers: Iterable) -> None:
        """Hook `layers` (modules: the transformer layers of every model the rank runs)."""
        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(self.adjust))
            self._hooks.append(layer.register_forward_hook(self._after_forward))

    def low_share(self) -> float:
        """The share of checks since the last call that found an engine generating."""
        share = self.low_checks / self.checks if self.checks else 0.0
        self.checks = self.low_checks = 0
        return share

    def restore(self) -> None:
        """All `high` threads again (between updates)."""
        if self._current != self.high:
            self._torch.set_num_threads(self.high)
            self._current = self.high

    def close(self) -> None:
        """Remove the hooks, restore the threads and unmap the watch."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.restore()
        self.watch.close()
