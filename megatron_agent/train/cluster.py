"""The Ray cluster and groups of worker actors: start or join, place, call, fail loudly.

`ray_cluster` (a context manager; its owner is the run, `train/run.py`, or a test) starts a local
cluster sized to the machine (lean: no dashboard or dashboard agent, no monitors, no prestarted
workers) or joins an existing one (`ray.address=auto` or `HOST:PORT`, how multi-node runs under
Slurm work), and stops what it started. `WorkerGroup` creates
N actors of one class inside a placement group, each writing its stdout/stderr to
`<run_dir>/logs/<name>_<rank>.log`, and `call` runs one method on all of them: a worker that
raises, dies or does not answer within the timeout becomes a `WorkerError` naming the worker,
its rank and the last lines of its log, never a hang. A worker whose process died is a
`WorkerDiedError` (rank, pid), which `replace(rank)` can answer with a new worker.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_agent.errors import RunFailure
from megatron_agent.platform import dashboard_agent_stand_in, setup_worker_stand_in


class WorkerError(RunFailure):
    """A worker raised, died or did not answer; the message names it and shows its log's tail."""


class WorkerDiedError(WorkerError):
    """A worker's process died (killed, crashed, out of memory): not a Python exception inside it.

    `rank` is the worker's rank in its group, `pid` its process id (None when Ray did not say)."""

    def __init__(self, message: str, rank: int, pid: int | None = None):
        super().__init__(message)
        self.rank, self.pid = rank, pid


# A local run has no use for Ray's idle-worker prestart (its actors bring their own environment
# variables, so a prestarted default worker is never reused), its log monitor (worker output goes
# to the run's log files, `log_to_driver=False`) or its autoscaler monitor (one node, no scaling).
LEAN_SYSTEM_CONFIG = {
    "enable_worker_prestart": False,
    "prestart_worker_first_driver": False,
    # The raylet connects to the object store it has just started on a thread, and a process to
    # a socket, retrying after this long: Ray's 1000 ms made a loaded machine's node start 1 s
    # late whenever the store was not listening yet at the first try. The same budget (10 s),
    # tried every 20 ms.
    "raylet_client_connect_timeout_milliseconds": 20,
    "raylet_client_num_connect_attempts": 500,
}
DASHBOARD_AGENT_STAND_IN = Path(dashboard_agent_stand_in.__file__)  # the raylet runs it as a script
SETUP_WORKER_STAND_IN = Path(setup_worker_stand_in.__file__)  # the raylet starts every worker with it
# the raylet runs it as a script (not imported here: it imports an HTTP server)
RUNTIME_ENV_AGENT_STAND_IN = DASHBOARD_AGENT_STAND_IN.with_name("runtime_env_agent_stand_in.py")
_local_node = None  # the lean local cluster's node (`start_local_node`), stopped by `stop_ray`


RAY_ENV = {"env_vars": {"PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}}


class RayStart:
    """Ray's start for one driver, begun on a background thread (`begin`) so that the driver's own
    start-up (its base model, tokenizer and tasks) overlaps it, and finished by `join`, which
    connects this process. `start_ray` does both at once.

    The thread sweeps what dead runs left behind, starts this run's reaper (every process started
    from then on carries the driver's run token) and, for a local cluster (address ''), starts
    its node (`start_local_node`); joining an existing cluster (`ray.address`) happens in `join`."""

    def __init__(self, address: str = "", num_cpus: int = 0):
        self.address, self.num_cpus = address, num_cpus
        self.seconds = 0.0  # how long the background part took
        self._local: str | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def begin(self) -> RayStart:
        """Start the background part (a no-op when this process is connected already)."""
        import ray

        if not ray.is_initialized():
            self._thread = threading.Thread(target=self._prepare, name="ray-start", daemon=True)
            self._thread.start()
        return self

    def join(self) -> bool:
        """Wait for the background part and connect; True when a local cluster was started here."""
        import ray

        if self._thread is None:  # connected already (a test's cluster, or a second start)
            return False
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        if self.address:
            try:
                ray.init(address=self.address, runtime_env=RAY_ENV, log_to_driver=False)
            except (ConnectionError, RuntimeError, TimeoutError) as exc:
                raise WorkerError(
                    f"could not join the Ray cluster at ray.address={self.address!r}: {exc} (is it "
                    "running, and reachable from this node? `ray status` on its head node says)"
                ) from None
            return False
        if self._local is not None:
            ray.init(address=self._local, runtime_env=RAY_ENV, log_to_driver=False, configure_logging=False)
            return True
        ray.init(  # this Ray's node API did not take the lean settings: ray.init's own cluster
            num_cpus=self.num_cpus or os.cpu_count(),
            include_dashboard=False,
            runtime_env=RAY_ENV,
            log_to_driver=False,
            configure_logging=False,
            _system_config=LEAN_SYSTEM_CONFIG,
        )
        return True

    def cancel(self) -> None:
        """Undo a begun start that will not be joined (bad input found meanwhile)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            stop_ray()

    def _prepare(self) -> None:
        from megatron_agent.platform.run_token import start_reaper, sweep_dead_runs

        begin = time.perf_counter()
        try:
            sweep_dead_runs()  # what runs killed without their reaper left behind
            start_reaper()  # every process started from here carries this driver's run token
            if not self.address:
                self._local = start_local_node(self.num_cpus or os.cpu_count() or 1)
        except BaseException as exc:  # noqa: BLE001 - raised again by join()
            self._error = exc
        self.seconds = time.perf_counter() - begin


def start_ray(address: str = "", num_cpus: int = 0) -> bool:
    """Start a local Ray cluster (address '') or join one; returns True when started here.

    The local cluster is lean (`start_local_node`): the dashboard, the log monitor, the
    autoscaler monitor and prestarted idle workers are off; actors, placement groups, the
    object store, runtime environments and death detection (what a run uses) are all there."""
    return RayStart(address, num_cpus).begin().join()


def start_local_node(num_cpus: int) -> str | None:
    """Start a lean one-node Ray cluster for this process; returns its address, or None when this
    Ray version's node API does not take these settings (then `ray.init` starts a full one).

    `ray.init` always starts a log monitor and an autoscaler monitor with a local cluster; Ray's
    node API (what `ray.init` calls, and `ray start` exposes as --no-monitor and
    --include-log-monitor) can leave them out. Ray's own reaper is not started either: the run's
    reaper (`platform/run_token.py`) ends every process of the run once the driver is gone.

    Nor is the dashboard's head process (`_NodeWithoutDashboard`): with `include_dashboard=False`
    Ray still starts it, with its usage-statistics module only, and waits for it to register
    before it starts the raylet: 0.8 s of the node's start and 116 MB, for nothing a run uses
    (actors, placement groups, the object store and runtime environments are the GCS's and the
    raylet's; Ray's job and state APIs, which need it, are not used). The raylet's two agents,
    which it cannot start without, are stand-ins: the dashboard agent's writes "no service" into
    its port files (`platform/dashboard_agent_stand_in.py`: `with_dashboard_agent_stand_in`), and
    the runtime-env agent's serves runtime environments of variables only, the only kind a run
    makes, without importing Ray (`platform/runtime_env_agent_stand_in.py`:
    `with_runtime_env_agent_stand_in`; 0.4 s off the node's start). Every worker
    starts through `platform/setup_worker_stand_in.py` instead of Ray's setup_worker.py: it sets
    the worker's variables and execs it without importing Ray's runtime-env package first (0.3-0.5 s
    off each actor's start), and hands any other runtime environment to Ray's script. The start
    returns as soon as the raylet has registered (`wait_for_registration`), not at Ray's next
    once-a-second ask (the node's start 1.27 -> 0.75 s)."""
    global _local_node
    try:
        from ray._private.node import Node
        from ray._private.parameter import RayParams

        class _NodeWithoutDashboard(Node):
            def start_api_server(self, **_options):
                """Not started (above)."""

            def start_raylet(self, *args, **kwargs):
                """Ray's raylet, given the stand-in for its dashboard agent (above). Ray imports
                its dashboard's dependencies here (aiohttp, prometheus, ...: 0.4 s of the driver's
                CPU) only to choose whether that agent runs minimal: it is told to, unchecked
                (what the stand-in ignores, and an agent without those dependencies does)."""
                from ray._private import ray_constants, services
                from ray._private import utils as ray_utils

                start_process = services.start_ray_process
                dependency_check = ray_utils.get_dashboard_dependency_error

                def start(command, process_type, *more, **options):
                    if process_type == ray_constants.PROCESS_TYPE_RAYLET:
                        command = with_runtime_env_agent_stand_in(with_dashboard_agent_stand_in(command))
                    return start_process(command, process_type, *more, **options)

                services.start_ray_process = start
                ray_utils.get_dashboard_dependency_error = dashboard_dependencies_unchecked
                try:
                    return super().start_raylet(*args, **kwargs)
                finally:
                    services.start_ray_process = start_process
                    ray_utils.get_dashboard_dependency_error = dependency_check

            def start_ray_processes(self):
                """Ray's processes, then the raylet's registration awaited as it happens: Ray's
                own wait asks the GCS once a second (`wait_for_registration`)."""
                super().start_ray_processes()
                wait_for_registration(self)

        params = RayParams(
            num_cpus=num_cpus,
            include_dashboard=False,
            include_log_monitor=False,
            no_monitor=True,
            _system_config=dict(LEAN_SYSTEM_CONFIG),
            setup_worker_path=str(SETUP_WORKER_STAND_IN),
        )
    except (ImportError, TypeError):  # another Ray version: ray.init's full cluster
        return None
    _local_node = _NodeWithoutDashboard(
        params, head=True, shutdown_at_exit=False, spawn_reaper=False, ray_init_cluster=True
    )
    return _local_node.address


def wait_for_registration(node, timeout_s: float = 30.0, interval_s: float = 0.02) -> bool:
    """Wait until `node`'s raylet has registered with the GCS, asking every `interval_s`; True
    once it has. Ray's node start asks once a second (its GCS client's `GetNode` sleeps 1 s
    between tries), so a raylet that registers just after the first try (here: 0.6-0.7 s after
    it starts, once the runtime-env agent has written its port) is seen up to a second later.
    False (Ray's own wait then decides) when the raylet's process has ended, the GCS cannot be
    asked, or `timeout_s` passes."""
    from ray._private import ray_constants

    deadline = time.monotonic() + timeout_s
    try:
        gcs = node.get_gcs_client()
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
        while time.monotonic() < deadline and raylet.poll() is None:
            infos = gcs.get_all_node_info(timeout=max(interval_s, 1.0))
            if any(n.hex() == node.node_id and info.state == info.ALIVE for n, info in infos.items()):
                return True
            time.sleep(interval_s)
    except Exception:  # noqa: BLE001 - Ray's own wait reports what went wrong
        return False
    return False


def dashboard_dependencies_unchecked() -> ImportError:
    """What the lean node's raylet start gets from Ray's dashboard-dependency check: "missing", so
    that a dashboard agent runs minimal, without importing them (`start_local_node`)."""
    return ImportError("not checked: a lean local node's dashboard agent runs minimal")


def with_dashboard_agent_stand_in(raylet_command: list[str]) -> list[str]:
    """The raylet's command line with `platform/dashboard_agent_stand_in.py` as its dashboard
    agent, given the three port files the raylet waits for; unchanged where this Ray's raylet
    takes other flags or names its port files otherwise (Ray's own agent then starts)."""
    try:
        from ray._raylet import (
            DASHBOARD_AGENT_LISTEN_PORT_NAME,
            METRICS_AGENT_PORT_NAME,
            METRICS_EXPORT_PORT_NAME,
            get_port_filename,
        )
    except ImportError:
        return raylet_command
    flags = _flags(raylet_command)
    if not {"node_id", "session_dir", "dashboard_agent_command"} <= flags.keys():
        return raylet_command
    port_files = [
        os.path.join(flags["session_dir"], get_port_filename(flags["node_id"], name))
        for name in (METRICS_AGENT_PORT_NAME, METRICS_EXPORT_PORT_NAME, DASHBOARD_AGENT_LISTEN_PORT_NAME)
    ]
    return _with_agent(raylet_command, "dashboard_agent_command", DASHBOARD_AGENT_STAND_IN, port_files)


def with_runtime_env_agent_stand_in(raylet_command: list[str]) -> list[str]:
    """The raylet's command line with `platform/runtime_env_agent_stand_in.py` as its runtime-env
    agent, on the address and port Ray's agent would take and writing the port file the raylet
    waits for; unchanged where this Ray's raylet or agent takes other flags (Ray's own agent then
    starts)."""
    try:
        from ray._raylet import RUNTIME_ENV_AGENT_PORT_NAME, get_port_filename
    except ImportError:
        return raylet_command
    agent = _flags(raylet_command).get("runtime_env_agent_command")
    try:
        flags = _flags(shlex.split(agent)) if agent else {}
    except ValueError:  # not a command line shlex reads
        return raylet_command
    if not {"node-id", "node-ip-address", "runtime-env-agent-port", "session-dir"} <= flags.keys():
        return raylet_command
    port_file = os.path.join(
        flags["session-dir"], get_port_filename(flags["node-id"], RUNTIME_ENV_AGENT_PORT_NAME)
    )
    address = [flags["node-ip-address"], flags["runtime-env-agent-port"], port_file]
    return _with_agent(raylet_command, "runtime_env_agent_command", RUNTIME_ENV_AGENT_STAND_IN, address)


def _flags(words: list[str]) -> dict[str, str]:
    """The `--name=value` words of a command line as {name: value}."""
    return dict(word[2:].split("=", 1) for word in words if word.startswith("--") and "=" in word)


def _with_agent(raylet_command: list[str], flag: str, script: Path, args: list[str]) -> list[str]:
    """The raylet's command line with its `--{flag}=` agent command replaced by `script` run with
    `args` in an isolated Python (`-S -I`: the stand-ins use the standard library only)."""
    agent = subprocess.list2cmdline([sys.executable, "-S", "-I", str(script), *args])
    prefix = f"--{flag}="
    return [prefix + agent if arg.startswith(prefix) else arg for arg in raylet_command]


def stop_ray() -> None:
    """Shut down this process's connection (and a local cluster it started)."""
    import ray

    global _local_node
    if ray.is_initialized():
        ray.shutdown()
    if _local_node is not None:
        node, _local_node = _local_node, None
        node.kill_all_processes(check_alive=False, allow_graceful=True)


@contextlib.contextmanager
def ray_cluster(address: str = "", num_cpus: int = 0, begun: RayStart | None = None) -> Iterator[bool]:
    """Ray for the duration of a block: a local cluster started (address '') or one joined; shut
    down at exit when this block started the connection. Yields whether it started it.
    `begun`: a `RayStart` begun earlier for this address (it is joined here)."""
    started = (begun or RayStart(address, num_cpus).begin()).join()
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


def finish_together(calls: dict[str, GroupCall]) -> dict[str, float]:
    """Wait for several group calls started together (e.g. the Megatron ranks' set-up and the
    engines' start); returns when each finished (`time.perf_counter()`, by name). The first call
    to fail, or not to finish within its group's timeout, raises its `WorkerError`, naming the
    worker (the others are left running: their owner kills them)."""
    import ray

    start = time.monotonic()
    deadlines = {
        name: start + (call.group.timeout_s if call.timeout_s is None else call.timeout_s)
        for name, call in calls.items()
    }
    pending = {name: set(call.refs) for name, call in calls.items()}
    done_at: dict[str, float] = {}
    while pending:
        now = time.monotonic()
        for name in pending:
            if now >= deadlines[name]:
                call = calls[name]
                ranks = [rank for ref, rank in zip(call.refs, call.ranks) if ref in pending[name]]
                raise call.group._error(
                    ranks, f"did not finish {call.method}() within {deadlines[name] - start:.0f} s"
                )
        remaining = min(deadlines[name] for name in pending) - now
        waiting = [ref for refs in pending.values() for ref in refs]
        ready, _ = ray.wait(waiting, num_returns=1, timeout=min(remaining, 5.0))
        for ref in ready:
            name = next(n for n, refs in pending.items() if ref in refs)
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - the call's own wait turns it into a WorkerError
                calls[name].result()
                raise
            pending[name].discard(ref)
            if not pending[name]:
                del pending[name]
                done_at[name] = time.perf_counter()
    return done_at


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
