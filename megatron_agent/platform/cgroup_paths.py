"""Where this process's cgroups are: the hierarchies' mount points and this process's place in
them (cgroup v1 per controller, or v2), read from /proc. Used by the python tool's per-call
cgroups (envs/tools/cgroups.py) and the free-memory check (free_memory.py)."""

from __future__ import annotations

from pathlib import Path


def cgroup_mounts(controllers) -> tuple[dict[str, Path], Path | None]:
    """The v1 mount point of each of `controllers`, and the v2 mount point (/proc/self/mountinfo)."""
    v1: dict[str, Path] = {}
    v2 = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return v1, v2
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount_point, fstype, options = Path(fields[4]), tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            v2 = v2 or mount_point
        elif fstype == "cgroup":
            for controller in controllers:
                if controller in options:
                    v1.setdefault(controller, mount_point)
    return v1, v2


def own_cgroups(controllers) -> tuple[dict[str, str], str | None]:
    """This process's cgroup path for each of `controllers` (v1), and its v2 path (/proc/self/cgroup)."""
    v1: dict[str, str] = {}
    v2 = None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return v1, v2
    for line in lines:
        _, listed, rel = line.split(":", 2)
        if listed == "":
            v2 = rel
        for controller in listed.split(","):
            if controller in controllers:
                v1[controller] = rel
    return v1, v2
