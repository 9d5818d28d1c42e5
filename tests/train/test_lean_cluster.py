"""The lean local Ray cluster (`start_ray`: no log monitor, no autoscaler monitor, no prestarted
idle workers, no dashboard, stand-ins for the dashboard agent and the runtime-env agent, workers
started through the setup-worker stand-in) serves every Ray feature a run uses: actors with their
own environment variables (and a runtime environment it does not serve is refused, named),
placement groups, the object store, `ray.wait` with a timeout, death
detection and replacement, `ray.kill`, the node's address; and `stop_ray` leaves no Ray process.

The tests share one cluster, in file order; the last one stops it.
"""

from __future__ import annotations

import os
import re
import textwrap
import time

import numpy as np
import psutil
import pytest

from megatron_agent.train.cluster import (
    WorkerDiedError,
    WorkerGroup,
    make_placement_group,
    start_ray,
    stop_ray,
    wait_for_registration,
)
from tests.conftest import fresh_python

# Processes Ray starts: its binaries (gcs_server, raylet), its Python processes (under .../ray/:
# the dashboard, its agents, the monitors, workers before they rename themselves), its workers
# ("ray::<class>", "ray::IDLE"), the raylet's agent stand-ins, and a worker still in the
# setup-worker stand-in.
RAY_PROCESS = re.compile(
    r"ray::|/ray/|\bgcs_server\b|\braylet\b|dashboard_agent_stand_in|runtime_env_agent_stand_in|setup_worker_stand_in"
)


def ray_processes() -> dict[int, str]:
    """{pid: command line} of the processes Ray started: this process's descendants, and any
    process carrying this run's token (a worker whose raylet is gone is no descendant any more)."""
    from megatron_agent.platform.run_token import current_token, processes_of

    pids = {p.pid for p in psutil.Process().children(recursive=True)}
    if current_token():
        pids |= set(processes_of(current_token()))
    found = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(process.cmdline()) or process.name()
        except psutil.Error:  # ended meanwhile
            continue
        if RAY_PROCESS.search(command):
            found[pid] = command
    return found


def _reaper() -> psutil.Process | None:
    """This driver's run-token reaper (`run_token.py reap`), a child of this process."""
    for process in psutil.Process().children():
        try:
            if "run_token.py reap" in " ".join(process.cmdline()):
                return process
        except psutil.Error:
            continue
    return None


class Probe:
    """A tiny actor that reports what it sees."""

    def __init__(self, rank, world, log_path):
        from megatron_agent.train.cluster import redirect_output

        redirect_output(log_path)
        self.rank = rank
        print(f"rank {rank} up as pid {os.getpid()}", flush=True)

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def pid(self) -> int:
        return os.getpid()

    def placement_group_id(self) -> str | None:
        import ray

        group = ray.util.get_current_placement_group()
        return None if group is None else group.id.hex()

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def measure(self, array: np.ndarray) -> tuple[int, float]:
        return int(array.nbytes), float(array.sum())

    def make(self, num_bytes: int) -> np.ndarray:
        return np.full(num_bytes // 8, 2.0)

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def exit_if(self, rank: int) -> int:
        if rank == self.rank:
            os._exit(3)
        return self.rank


@pytest.fixture(scope="module")
def lean(tmp_path_factory):
    """The module's cluster: what Ray started right after `start_ray`, and a log folder."""
    import megatron_agent.train.cluster as cluster

    assert start_ray(num_cpus=2), "Ray was already connected in this process: not the lean start"
    assert cluster._local_node is not None, "start_local_node fell back to ray.init's full cluster"
    yield {"at_start": ray_processes(), "log_dir": tmp_path_factory.mktemp("lean_logs")}
    stop_ray()


@pytest.fixture
def make_group(lean):
    made = []

    def make(name: str, num_workers: int, **options) -> WorkerGroup:
        options.setdefault("num_cpus", 0)
        group = WorkerGroup(Probe, num_workers, name=name, log_dir=lean["log_dir"], timeout_s=60, **options)
        made.append(group)
        return group

    yield make
    for group in made:
        group.kill()


def _no_monitors_or_idle_workers(processes: dict[int, str]) -> None:
    commands = list(processes.values())
    assert not [c for c in commands if "log_monitor.py" in c], commands
    assert not [c for c in commands if re.search(r"autoscaler/_private/monitor\.py|/monitor\.py", c)], (
        commands
    )
    assert not [c for c in commands if c.startswith("ray::IDLE")], commands
    # No dashboard head (Ray starts one even with include_dashboard=False), and the raylet's
    # two agents are the stand-ins.
    assert not [c for c in commands if "dashboard/dashboard.py" in c], commands
    assert not [c for c in commands if "dashboard/agent.py" in c], commands
    assert not [c for c in commands if "runtime_env/agent/main.py" in c], commands


def test_the_lean_node_starts_no_monitors_and_no_idle_workers(lean):
    commands = list(lean["at_start"].values())
    assert any("gcs_server" in c for c in commands) and any("raylet" in c for c in commands), commands
    _no_monitors_or_idle_workers(lean["at_start"])
    for agent in ("dashboard_agent_stand_in.py", "runtime_env_agent_stand_in.py"):
        (stand_in,) = [  # the raylet's own command line names it too
            pid for pid, c in lean["at_start"].items() if agent in c and "raylet_socket" not in c
        ]
        assert psutil.Process(stand_in).memory_info().rss < 30 * 2**20
    (raylet,) = [c for c in commands if "raylet_socket" in c]  # it starts its workers with the stand-in
    assert re.search(r"--python_worker_command=\S*python\S* \S*/setup_worker_stand_in\.py ", raylet), raylet
    assert "workers/setup_worker.py" not in raylet


def test_the_cluster_retries_its_socket_connections_every_20_ms(lean):
    from ray._private.state import state

    # the raylet reads its configuration from the GCS: a store not listening yet at the raylet's
    # first try costs 20 ms, not Ray's 1 s, and the 10 s budget is kept
    config = state.get_system_config()
    assert config["raylet_client_connect_timeout_milliseconds"] == 20
    assert config["raylet_client_num_connect_attempts"] * 20 == 10_000


def test_actors_get_their_own_environment_variables(lean, make_group):
    from megatron_agent.platform.run_token import current_token

    first = make_group("first", 2, env_vars={"LEAN_TEST_VALUE": "a"})
    second = make_group("second", 1, env_vars={"LEAN_TEST_VALUE": "b", "OMP_NUM_THREADS": "1"})
    assert first.call("env", "LEAN_TEST_VALUE") == ["a", "a"]
    assert second.call("env", "LEAN_TEST_VALUE") == ["b"] and second.call("env", "OMP_NUM_THREADS") == ["1"]
    # the cluster's own variables too, and the run token the reaper finds the run's processes by
    assert first.call("env", "PYTHONUNBUFFERED") == ["1", "1"]
    assert current_token() and second.call("env", "MEGATRON_AGENT_RUN_TOKEN") == [current_token()]


def test_a_runtime_environment_beyond_variables_is_refused_naming_its_field(lean):
    import ray

    probe = ray.remote(num_cpus=0)(Probe).options(runtime_env={"pip": ["not-installed-anywhere"]})
    actor = probe.remote(0, 1, str(lean["log_dir"] / "pip.log"))
    with pytest.raises(ray.exceptions.RuntimeEnvSetupError, match=r"\['pip'\].*lean local Ray cluster"):
        ray.get(actor.pid.remote(), timeout=60)


def test_a_placement_group_places_its_workers(lean, make_group):
    from ray.util.placement_group import remove_placement_group

    group = make_placement_group(2, cpus=1, gpus=0, timeout_s=60)
    try:
        placed = make_group("placed", 2, num_cpus=1, placement_group=group)
        assert placed.call("placement_group_id") == [group.id.hex()] * 2
        assert make_group("loose", 1).call("placement_group_id") == [None]
    finally:
        remove_placement_group(group)  # its actors with it


def test_the_object_store_carries_50_mb(lean, make_group):
    import ray

    (worker,) = make_group("store", 1).workers
    array = np.arange(50 * 2**20 // 8, dtype=np.float64)
    ref = ray.put(array)
    np.testing.assert_array_equal(ray.get(ref), array)
    assert ray.get(worker.measure.remote(ref), timeout=60) == (array.nbytes, float(array.sum()))
    made = ray.get(worker.make.remote(50 * 2**20), timeout=60)
    assert made.nbytes == 50 * 2**20 and float(made[::4096].min()) == 2.0


def test_ray_wait_returns_at_its_timeout(lean, make_group):
    import ray

    (worker,) = make_group("waiter", 1).workers
    ray.get(worker.pid.remote(), timeout=60)  # constructed
    ref = worker.sleep.remote(3.0)
    start = time.monotonic()
    ready, pending = ray.wait([ref], timeout=0.5)
    waited = time.monotonic() - start
    assert ready == [] and pending == [ref] and 0.4 < waited < 2.5, waited
    ready, pending = ray.wait([ref], timeout=30)
    assert ready == [ref] and ray.get(ref) == 3.0


def test_a_worker_that_exits_is_named_with_its_pid_and_replaced(lean, make_group):
    group = make_group("mortal", 2)
    pids = group.call("pid")
    with pytest.raises(WorkerDiedError) as err:
        group.call("exit_if", 1)
    assert err.value.rank == 1 and err.value.pid == pids[1], (str(err.value), pids)
    assert "mortal worker rank 1 died during exit_if()" in str(err.value)
    group.replace(1)
    new = group.call("pid")
    assert new[0] == pids[0] and new[1] != pids[1]
    assert group.call("exit_if", -1) == [0, 1]  # the new rank 1 answers as rank 1
    log = (lean["log_dir"] / "mortal_1.log").read_text()
    assert f"rank 1 up as pid {pids[1]}" in log and f"rank 1 up as pid {new[1]}" in log


def test_ray_kill_ends_the_actor_and_its_process(lean, make_group):
    import ray

    (worker,) = make_group("killed", 1).workers
    pid = ray.get(worker.pid.remote(), timeout=60)
    ray.kill(worker)
    # ray.kill returns before the actor is gone: a call sent right after may still be answered
    # (seen once under the CI suite). Within 20 s every call must fail.
    deadline = time.monotonic() + 20
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(worker.pid.remote(), timeout=60)
            time.sleep(0.1)
    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the killed actor's process {pid} still runs"
        time.sleep(0.1)


def test_the_node_ip_address_is_the_same_for_driver_workers_and_cluster(lean, make_group):
    import ray

    address = ray.util.get_node_ip_address()
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", address), address
    assert make_group("ip", 1).call("node_ip") == [address]
    assert [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]] == [address]


def test_the_lean_nodes_start_sees_its_raylet_register():
    # Ray's own wait asks the GCS once a second; the lean node's start asks every 20 ms first
    code = textwrap.dedent(
        """
        import json
        import megatron_agent.train.cluster as cluster
        seen = []
        wait = cluster.wait_for_registration
        cluster.wait_for_registration = lambda node, **options: seen.append(wait(node, **options)) or seen[-1]
        cluster.start_ray(num_cpus=1)
        import ray
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        cluster.stop_ray()
        print(json.dumps({"seen": seen, "alive": alive}))
        """
    )
    out = fresh_python(code)
    assert out["seen"] == [True] and len(out["alive"]) == 1, out


class FakeGcs:
    """Lists the node as alive from its `alive_from`-th ask on (raises instead with `error`)."""

    class NodeId:
        def __init__(self, hex_id: str):
            self.hex_id = hex_id

        def hex(self) -> str:
            return self.hex_id

    class Info:
        ALIVE, DEAD = 0, 1

        def __init__(self, state: int):
            self.state = state

    def __init__(self, node_id: str, alive_from: int, error: Exception | None = None):
        self.node_id, self.alive_from, self.error, self.asks = node_id, alive_from, error, 0

    def get_all_node_info(self, timeout=None):
        self.asks += 1
        if self.error is not None:
            raise self.error
        other = {self.NodeId("other"): self.Info(self.Info.ALIVE)}
        state = self.Info.ALIVE if self.asks >= self.alive_from else self.Info.DEAD
        return {**other, self.NodeId(self.node_id): self.Info(state)} if self.asks >= 2 else other


class FakeNode:
    def __init__(self, gcs: FakeGcs, raylet_exit_code: int | None = None):
        from ray._private import ray_constants

        class Raylet:
            def poll(self):
                return raylet_exit_code

        class Info:
            process = Raylet()

        self.node_id, self.gcs = gcs.node_id, gcs
        self.all_processes = {ray_constants.PROCESS_TYPE_RAYLET: [Info()]}

    def get_gcs_client(self):
        return self.gcs


def test_the_registration_is_seen_as_soon_as_the_node_is_alive():
    gcs = FakeGcs("ab12", alive_from=4)  # absent, dead (registering), then alive
    assert wait_for_registration(FakeNode(gcs), timeout_s=10, interval_s=0.001) is True
    assert gcs.asks == 4


def test_a_raylet_that_ended_or_a_gcs_that_fails_leaves_the_wait_to_ray():
    never = FakeGcs("ab12", alive_from=10**9)
    assert wait_for_registration(FakeNode(never, raylet_exit_code=1), timeout_s=30) is False
    assert never.asks == 0  # not asked: the raylet had ended
    assert (
        wait_for_registration(FakeNode(FakeGcs("ab12", 1, error=RuntimeError("no GCS"))), timeout_s=30)
        is False
    )
    assert wait_for_registration(FakeNode(never), timeout_s=0.05, interval_s=0.001) is False
    assert never.asks >= 1


def test_the_lean_start_does_not_import_the_dashboards_dependencies():
    # Ray imports them (aiohttp, prometheus, ...) only to choose a minimal dashboard agent; the
    # lean node tells it "minimal" unchecked, and restores the check after the raylet's start.
    code = textwrap.dedent(
        """
        import json, sys
        import ray._private.utils as ray_utils
        from megatron_agent.train.cluster import start_ray, stop_ray
        check = ray_utils.get_dashboard_dependency_error
        start_ray(num_cpus=1)
        loaded = [m for m in ("ray.dashboard.optional_deps", "aiohttp") if m in sys.modules]
        restored = ray_utils.get_dashboard_dependency_error is check
        stop_ray()
        print(json.dumps({"loaded": loaded, "restored": restored}))
        """
    )
    assert fresh_python(code) == {"loaded": [], "restored": True}


def test_stop_ray_leaves_no_ray_process_but_the_reaper(lean):
    import ray

    import megatron_agent.train.cluster as cluster

    _no_monitors_or_idle_workers(ray_processes())  # after all the actors above, still none
    stop_ray()
    assert not ray.is_initialized() and cluster._local_node is None
    deadline = time.monotonic() + 20
    while left := ray_processes():
        assert time.monotonic() < deadline, f"left after stop_ray: {left}"
        time.sleep(0.2)
    reaper = _reaper()
    assert reaper is not None and reaper.is_running()  # it outlives the cluster: it watches the driver
