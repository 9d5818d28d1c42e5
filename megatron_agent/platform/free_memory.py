"""The memory this machine (or this process's container) can still give: what capacity checks use."""

from __future__ import annotations

from pathlib import Path

from megatron_agent.platform.cgroup_paths import cgroup_mounts, own_cgroups


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
    mounts_v1, mount_v2 = cgroup_mounts(("memory",))
    own_v1, own_v2 = own_cgroups(("memory",))
    if "memory" in mounts_v1 and "memory" in own_v1:
        base, files = (
            mounts_v1["memory"] / own_v1["memory"].lstrip("/"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        )
    elif mount_v2 is not None and own_v2 is not None:
        base, files = mount_v2 / own_v2.lstrip("/"), ("memory.max", "memory.current")
    else:
        return None
    try:
        limit, usage = ((base / name).read_text().strip() for name in files)
    except OSError:
        return None
    if limit == "max" or int(limit) >= 1 << 60:
        return None
    return max(0, int(limit) - int(usage))


def available_memory_bytes() -> int:
    """MemAvailable, or the headroom of this process's memory cgroup when that is smaller."""
    figures = [f for f in (_meminfo_available(), _cgroup_headroom()) if f is not None]
    return min(figures) if figures else 0
