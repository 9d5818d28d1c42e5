"""One cgroup per python-tool call: its memory (every process, every tmpfs page) and its process
count under one limit, and every process of the call killed at the end.

Works with cgroup v1 (a `memory` and a `pids` hierarchy) and cgroup v2 (one unified hierarchy
whose parent delegates `memory` and `pids`). A call's cgroups are created next to this process's
own (children of its cgroup), so a job's own limit (Slurm, a container) still holds above them.
`support()` probes once what this machine lets this process create; `CallCgroup` is one call's.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_agent.platform.cgroup_paths import cgroup_mounts, own_cgroups
from megatron_agent.platform.run_token import process_token, token_alive

CONTROLLERS = ("memory", "pids")
_counter = itertools.count()
_swept: set[frozenset[Path]] = set()  # where `remove_orphans` ran in this process
_OWNED = re.compile(r"ma_python_(\d+)_(\d+\.\d+)_")  # what a call makes: its owner's tag, then its own part


@dataclass(frozen=True)
class Support:
    """Where this process can create a call's cgroups: a parent folder per controller."""

    version: int
    """1 or 2."""
    parents: dict[str, Path]
    """Controller name (memory, pids) -> the folder new call cgroups are made in."""

    def describe(self) -> str:
        """E.g. 'cgroup v1 (memory, pids)'."""
        return f"cgroup v{self.version} ({', '.join(sorted(self.parents))})"


def _writable(parent: Path, limit_file: str, value: str) -> bool:
    """Whether a child cgroup can be made in `parent` and its `limit_file` written."""
    test = parent / f"ma_python_probe_{os.getpid()}_{next(_counter)}"
    try:
        test.mkdir()
        (test / limit_file).write_text(value)
        return True
    except OSError:
        return False
    finally:
        try:
            test.rmdir()
        except OSError:
            pass


@functools.cache
def support() -> Support | None:
    """Where call cgroups holding both memory and pids can be made here, or None (cached).

    v1 needs both hierarchies writable; v2 needs this process's cgroup to delegate both
    controllers to its children (`cgroup.subtree_control`), as a root or a systemd-delegated
    cgroup does."""
    mounts_v1, mount_v2 = cgroup_mounts(CONTROLLERS)
    own_v1, own_v2 = own_cgroups(CONTROLLERS)
    limits = {"memory": ("memory.limit_in_bytes", str(64 << 20)), "pids": ("pids.max", "8")}
    if all(c in mounts_v1 and c in own_v1 for c in CONTROLLERS):
        parents = {c: mounts_v1[c] / own_v1[c].lstrip("/") for c in CONTROLLERS}
        if all(_writable(parents[c], *limits[c]) for c in CONTROLLERS):
            return Support(1, parents)
    if mount_v2 is not None and own_v2 is not None:
        parent = mount_v2 / own_v2.lstrip("/")
        try:
            delegated = (parent / "cgroup.subtree_control").read_text().split()
        except OSError:
            delegated = []
        if all(c in delegated for c in CONTROLLERS) and _writable(parent, "memory.max", str(64 << 20)):
            return Support(2, {c: parent for c in CONTROLLERS})
    return None


def remove_orphans(where: Support | None = None) -> list[str]:
    """Remove the call cgroups whose owner has died, killing what is still in them; return their
    names.

    A process killed while its calls ran (SIGKILL, the OOM killer) never closed their cgroups:
    they stayed under the job's cgroup, one per call, empty folders or with a call's processes
    still in them. A call's cgroup is named after its owner (`owner_tag`); one whose owner is in
    this process's pid namespace and no longer runs is an orphan (`left_by_dead_owner`; another
    namespace's are never touched).
    Once per process and place (`sweep_once`): when the python tool is made, and before a
    `CallCgroup`'s first call there."""
    where = where or support()
    if where is None:
        return []
    found: dict[str, list[Path]] = {}
    for parent in set(where.parents.values()):
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for folder in entries:
            if left_by_dead_owner(folder.name) and folder.is_dir():
                found.setdefault(folder.name, []).append(folder)
    for name, dirs in found.items():
        kill_file = where.parents["memory"] / name / "cgroup.kill" if where.version == 2 else None
        _kill_and_remove(sorted(dirs), kill_file)
    return sorted(found)


def sweep_once(where: Support) -> None:
    """`remove_orphans(where)`, the first time this process asks for `where`."""
    place = frozenset(where.parents.values())
    if place not in _swept:
        _swept.add(place)
        remove_orphans(where)


def owner_tag() -> str:
    """`<pid namespace>_<pid>.<start ticks>` of this process (`run_token.process_token`), in the
    names of what its calls make (cgroups, working folders): a reused pid does not pass for their
    owner, and a sweep in another pid namespace (a container sharing the folder) leaves them be."""
    return _owner_tag(os.getpid())


def left_by_dead_owner(name: str) -> bool:
    """Whether `name` is one of a call's (`ma_python_<owner_tag>_...`) whose owner is in this pid
    namespace and no longer runs."""
    match = _OWNED.match(name)
    return bool(match) and match.group(1) == str(_pid_namespace()) and not token_alive(match.group(2))


@functools.cache
def _owner_tag(pid: int) -> str:  # by pid: a forked child has its own
    return f"{_pid_namespace()}_{process_token(pid)}"


@functools.cache
def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class CallCgroup:
    """The cgroup(s) of one call: `memory_bytes` for all its memory, at most `max_pids` tasks.

    `enter` (a preexec function: it runs in the child before exec) puts the call's first process
    in; everything it starts stays in. `close` kills whatever is left and removes the cgroups.
    Raises OSError when they cannot be created."""

    def __init__(self, memory_bytes: int, max_pids: int, where: Support | None = None):
        """Create the cgroups under `where` (default `support()`)."""
        where = where or support()
        if where is None:
            raise OSError("no writable memory and pids cgroups")
        sweep_once(where)
        self.version = where.version
        name = f"ma_python_{owner_tag()}_{next(_counter)}"
        self.dirs = sorted({parent / name for parent in where.parents.values()})
        self.memory_dir = where.parents["memory"] / name
        self.pids_dir = where.parents["pids"] / name
        try:
            for folder in self.dirs:
                folder.mkdir()
            if self.version == 1:
                (self.memory_dir / "memory.limit_in_bytes").write_text(str(memory_bytes))
                _try_write(self.memory_dir / "memory.memsw.limit_in_bytes", str(memory_bytes))
            else:
                (self.memory_dir / "memory.max").write_text(str(memory_bytes))
                _try_write(self.memory_dir / "memory.swap.max", "0")
            (self.pids_dir / "pids.max").write_text(str(max_pids))
        except OSError:
            self.close()
            raise

    def enter(self) -> None:
        """Move the calling process into the call's cgroups."""
        for folder in self.dirs:
            with open(folder / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        """The most memory the call held at once (None where the kernel does not say)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.memory_dir / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes of the call killed at its memory limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.memory_dir / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def close(self) -> None:
        """Kill every process still in the call's cgroups, then remove them."""
        _kill_and_remove(self.dirs, self.memory_dir / "cgroup.kill" if self.version == 2 else None)


def _pids(dirs: list[Path]) -> set[int]:
    pids: set[int] = set()
    for folder in dirs:
        try:
            pids.update(int(p) for p in (folder / "cgroup.procs").read_text().split())
        except OSError:
            pass
    return pids


def _kill_and_remove(dirs: list[Path], kill_file: Path | None) -> None:
    """Kill every process in the cgroup folders `dirs` (through `kill_file`, v2's `cgroup.kill`,
    where there is one, and one by one), then remove the folders."""
    if kill_file is not None:
        _try_write(kill_file, "1")
    deadline = time.monotonic() + 5.0
    while (pids := _pids(dirs)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    for folder in dirs:
        for _ in range(200):  # a killed task leaves its cgroup a moment after it is reaped
            try:
                folder.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.005)


def _try_write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass
