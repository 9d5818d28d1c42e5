"""The memory this machine (or this process's container) can still give: what capacity checks use."""

from __future__ import annotations

from pathlib import Path


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    """Limit minus usage of this process's memory cgroup (v1 or v2), None when unlimited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, files = (
                Path("/sys/fs/cgroup/memory") / rel.lstrip("/"),
                ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            )
        elif controllers == "":
            base, files = Path("/sys/fs/cgroup") / rel.lstrip("/"), ("memory.max", "memory.current")
        else:
            continue
        try:
            limit, usage = ((base / name).read_text().strip() for name in files)
        except OSError:
            continue
        if limit == "max" or int(limit) >= 1 << 60:
            continue
        return max(0, int(limit) - int(usage))
    return None


def available_memory_bytes() -> int:
    """MemAvailable, or the headroom of this process's memory cgroup when that is smaller."""
    figures = [f for f in (_meminfo_available(), _cgroup_headroom()) if f is not None]
    return min(figures) if figures else 0
