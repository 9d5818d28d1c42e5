"""The Ray cluster and groups of worker actors: start or join, place, call, fail loudly.

`ray_cluster` (a context manager; its owner is the run, `train/run.py`, or a test) starts a local
cluster sized to the machine (dashboard off) or joins an existing one (`ray.address=auto` or
`HOST:PORT`, how multi-node runs under Slurm work), and stops what it started. `WorkerGroup` creates
N actors of one class inside a placement group, each writing its stdout/stderr to
`<run_dir>/logs/<name>_<rank>.log`, and `call` runs one method on all of them: a worker that
raises, dies or does not answer within the timeout becomes a `WorkerError` naming the worker,
its rank and the last lines of its log, never a hang. A worker whose process died is a
`WorkerDiedError` (rank, pid), which `replace(rank)` can answer with a new worker.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_agent.errors import RunFailure


class WorkerError(RunFailure):
    """A worker raised, died or did not answer; the message names it and shows its log's tail."""


class WorkerDiedError(WorkerError):
    """A worker's process died (killed, crashed, out of memory): not a Python exception inside it.

    `rank` is the worker's rank in its group, `pid` its process id (None when Ray did not say)."""

    def __init__(self, message: str, rank: int, pid: int | None = None):
        super().__init__(message)
        self.rank, self.pid = rank, pid


def start_ray(address: str = "", num_cpus: int = 0) -> bool:
    """Start a local Ray cluster (address '') or join one; returns True when started here."""
    import ray

    from megatron_agent.platform.run_token import start_reaper, sweep_dead_runs

    if ray.is_initialized():
        return False
    sweep_dead_runs()  # what runs killed without their reaper left behind
    start_reaper()  # every process started from here carries this driver's run token
    env = {"env_vars": {"PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
        return False
    ray.init(
        num_cpus=num_cpus or os.cpu_count(),
        include_dashboard=False,
        runtime_env=env,
        log_to_driver=False,
        configure_logging=False,
    )
    return True


def stop_ray() -> None:
    """Shut down this process's connection (and a local cluster it started)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@contextlib.contextmanager
def ray_cluster(address: str = "", num_cpus: int = 0) -> Iterator[bool]:
    """Ray for the duration of a block: a local cluster started (address '') or one joined; shut
    down at exit when this block started the connection. Yields whether it started it."""
    started = start_ray(address, num_cpus)
    try:
        yield started
    finally:
        if started:
            stop_ray()


def redirect_output(log_path: str | os.PathLike) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to `log_path` (append)."""
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)


def log_tail(path: str | os.PathLike, num_lines: int = 20) -> str:
    """The last `num_lines` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


class WorkerGroup:
    """N Ray actors of one class, placed in one placement group, called together."""

    def __init__(
        self,
        actor_cls: type,
        num_workers: int,
        *,
        name: str,
        log_dir: str | os.PathLike,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        placement_group=None,
        bundle_offset: int = 0,
        init_args: Sequence[Any] = (),
        timeout_s: float = 600.0,
        env_vars: dict[str, str] | None = None,
    ):
        """Create the actors; actor i gets `(rank=i, num_workers, log_path, *init_args)`.

        With `placement_group`, actor i goes into bundle `bundle_offset + i`.
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = name
        self.timeout_s = timeout_s
        self.log_paths = [Path(log_dir) / f"{name}_{rank}.log" for rank in range(num_workers)]
        remote_cls = ray.remote(actor_cls)
        self.workers = []
        self._start_args = (remote_cls, [], tuple(init_args))  # for `replace`
        for rank in range(num_workers):
            options: dict[str, Any] = dict(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                # One thread: megatron's CPU redirection (a TorchFunctionMode) and vLLM's
                # OpenMP binding belong to the thread that set them up.
                max_concurrency=1,
                runtime_env={"env_vars": dict(env_vars or {})},
            )
            if placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group,
                    placement_group_bundle_index=bundle_offset + rank,
                )
            self._start_args[1].append(options)
            self.workers.append(
                remote_cls.options(**options).remote(rank, num_workers, str(self.log_paths[rank]), *init_args)
            )

    def replace(self, rank: int):
        """Kill worker `rank` (if still there) and start a new one with the same rank, placement,
        options and init args (its log appends to the same file); returns the new handle."""
        import ray

        try:
            ray.kill(self.workers[rank])
        except Exception:  # already dead
            pass
        remote_cls, options, init_args = self._start_args
        self.workers[rank] = remote_cls.options(**options[rank]).remote(
            rank, len(self.workers), str(self.log_paths[rank]), *init_args
        )
        return self.workers[rank]

    def __len__(self) -> int:
        return len(self.workers)

    def submit(
        self,
        method: str,
        *args,
        timeout_s: float | None = None,
        per_worker_args: Sequence[Sequence[Any]] | None = None,
        ranks: Sequence[int] | None = None,
        **kwargs,
    ) -> GroupCall:
        """Start `method(*args, **kwargs)` on every worker (or `ranks`) and return at once: the
        `GroupCall` future's `result()` waits (an asynchronous loop overlaps several of them).

        `per_worker_args[i]` replaces `args` for the i-th called worker."""
        ranks = list(range(len(self.workers))) if ranks is None else list(ranks)
        refs = []
        for i, rank in enumerate(ranks):
            worker_args = per_worker_args[i] if per_worker_args is not None else args
            refs.append(getattr(self.workers[rank], method).remote(*worker_args, **kwargs))
        return GroupCall(self, refs, ranks, method, timeout_s)

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        """`submit(...).result()`: the results in rank order. Raises `WorkerError` on the first
        failure, or when the call is not done within `timeout_s` (default: the group's)."""
        return self.submit(method, *args, **kwargs).result()

    def wait(self, refs: list, ranks: Sequence[int], what: str, timeout_s: float | None = None) -> list[Any]:
        """Results of `refs` (one per rank of `ranks`); the first failure raises `WorkerError`."""
        import ray

        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._error(
                    [rank_of[r] for r in pending], f"did not finish {what}() within {timeout:.0f} s"
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, 5.0))
            for ref in ready:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    rank = rank_of[ref]
                    if getattr(exc, "actor_init_failed", False):  # a Python error in __init__
                        raise self._error(
                            [rank], f"failed to start (before {what}()): {_short(exc)}"
                        ) from None
                    error = self._error([rank], f"died during {what}(): {_short(exc)}")
                    raise WorkerDiedError(str(error), rank, _pid(exc)) from None
                except ray.exceptions.RayTaskError as exc:
                    raise self._error([rank_of[ref]], f"raised in {what}(): {_short(exc)}") from None
        return [results[rank] for rank in ranks]

    def _error(self, ranks: list[int], what: str) -> WorkerError:
        rank = ranks[0]
        others = f" (and ranks {ranks[1:]})" if len(ranks) > 1 else ""
        tail = log_tail(self.log_paths[rank])
        log = f"\nlast lines of {self.log_paths[rank]}:\n{tail}" if tail else ""
        return WorkerError(f"{self.name} worker rank {rank}{others} {what}{log}")

    def kill(self) -> None:
        """Kill every actor (no graceful exit)."""
        import ray

        for worker in self.workers:
            try:
                ray.kill(worker)
            except Exception:  # already dead
                pass


class GroupCall:
    """A method call running on several workers of a group (a future): `result()` waits for all
    of them, in rank order, with the group's failure handling (`WorkerGroup.wait`)."""

    def __init__(
        self, group: WorkerGroup, refs: list, ranks: list[int], method: str, timeout_s: float | None
    ):
        self.group, self.refs, self.ranks, self.method, self.timeout_s = group, refs, ranks, method, timeout_s

    def result(self) -> list[Any]:
        """The results in rank order; raises `WorkerError` naming a failed or late worker."""
        return self.group.wait(self.refs, self.ranks, self.method, self.timeout_s)


def _short(exc: BaseException) -> str:
    """The useful part of a Ray exception: the remote traceback's last lines."""
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-12:])


def _pid(exc: BaseException) -> int | None:
    """The dead worker's pid from Ray's death report ('pid: N'), or None."""
    import re

    found = re.search(r"\bpid: (\d+)", str(exc))
    return int(found.group(1)) if found else None


def make_placement_group(num_bundles: int, *, cpus: float, gpus: float, timeout_s: float = 120.0):
    """A PACK placement group of `num_bundles` bundles; a clear error if it cannot be placed."""
    import ray
    from ray.util.placement_group import placement_group

    bundle: dict[str, float] = {"CPU": cpus}
    if gpus:
        bundle["GPU"] = gpus
    group = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        total = ray.cluster_resources()
        raise WorkerError(
            f"could not place {num_bundles} bundles of {bundle} within {timeout_s:.0f} s; the cluster "
            f"has {total}. Lower parallel.tp/pp or the number of workers, or add nodes."
        )
    return group
