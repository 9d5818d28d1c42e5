"""The parallel start-up (Ray in the background, the Megatron ranks and the engines together) on the
real stack: a worker that fails to start is still named, whatever kind it is; `finish_together`
with tiny actors; the start-up clock's metrics and log line; the process tree's memory sampler.

- Ray: a run whose `ray.address` cannot be joined exits with one error line naming Ray and the
  address (no traceback without --debug).
- Megatron: a rank whose `setup` raises is a `WorkerError` naming it, raised while the engine is
  still building vLLM; `Trainer.close()` then ends both groups.
- Engine: an engine whose constructor raises is a `WorkerError` naming it ("failed to start").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from megatron_agent.train.cluster import WorkerError, WorkerGroup, finish_together, ray_cluster
from tests.conftest import REPO, quickstart_train_cmd

# The quickstart at its smallest: no SFT, one engine, one rank, a handful of tasks.
TINY = [
    "sft.steps=0",
    "data.num_synthetic_tasks=4",
    "data.num_synthetic_val_tasks=2",
    "logging.plot=false",
    "trainer.worker_timeout_s=180",
]


@pytest.fixture(scope="module")
def cluster(repo_on_pythonpath):
    """One local Ray cluster for the module (its workers import `tests.*`)."""
    with ray_cluster(num_cpus=2):
        yield


def _trainer(run_dir):
    from megatron_agent.config import load_config
    from megatron_agent.train.trainer import Trainer

    cfg = load_config(REPO / "examples/quickstart/config.yaml", [*TINY, f"trainer.run_dir={run_dir}"])
    return Trainer(cfg)


def _assert_gone(workers, within_s: float = 30.0) -> None:
    """Every actor in `workers` is dead within `within_s` (`ray.kill` returns before it is)."""
    import ray

    deadline = time.monotonic() + within_s
    for worker in workers:
        while True:
            try:
                ray.get(worker.ping.remote(), timeout=within_s)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, f"{worker} still answers after Trainer.close()"
            time.sleep(0.2)


# ----------------------------------------------------------------------------- a worker that fails
def test_a_ray_cluster_that_cannot_be_joined_is_one_named_error(tmp_path):
    # Nothing listens on port 1. Ray would retry its connection for minutes (about 36 s per
    # attempt, 20 attempts); these settings of Ray's own make it give up after one short attempt.
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        RAY_gcs_server_port_wait_time_s="1",
        RAY_py_gcs_connect_timeout_s="2",
        RAY_gcs_rpc_server_connect_timeout_s="1",
    )
    cmd = quickstart_train_cmd(tmp_path / "run", *TINY, "ray.address=127.0.0.1:1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode in (1, 2), (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors, proc.stderr[-3000:]
    assert "Ray" in errors[-1] and "127.0.0.1:1" in errors[-1], errors[-1]


def test_a_megatron_rank_failing_its_setup_is_named_while_the_engine_starts(cluster, tmp_path):
    import ray

    from tests.train.failing_workers import SETUP_REASON, FailingSetupMegatronWorker

    t = _trainer(tmp_path / "run")
    start = time.monotonic()
    try:
        with pytest.raises(WorkerError) as err:
            t.start(actor_cls=FailingSetupMegatronWorker)
        elapsed = time.monotonic() - start
        # The engine answers a ping once vLLM is built (its constructor returned): not yet.
        ready, _ = ray.wait([t.engines.workers[0].ping.remote()], timeout=0)
    finally:
        t.close()
    text = str(err.value)
    assert "megatron worker rank 0 raised in setup()" in text and SETUP_REASON in text, text
    assert "rank 0 setting up" in text  # the tail of the rank's log
    assert not ready, f"the engine was up before the rank's error ({elapsed:.1f} s): not raised at once"
    _assert_gone([*t.actors.workers, *t.engines.workers])


def test_an_engine_that_fails_to_start_is_named(cluster, tmp_path):
    from tests.train.failing_workers import ENGINE_REASON, FailingEngine

    t = _trainer(tmp_path / "run")
    try:
        with pytest.raises(WorkerError) as err:
            t.start(engine_cls=FailingEngine)
    finally:
        t.close()
    text = str(err.value)
    assert "rollout worker rank 0 failed to start (before ping())" in text and ENGINE_REASON in text, text
    assert "engine 0 starting" in text  # the tail of the engine's log
    _assert_gone([*t.actors.workers, *t.engines.workers])


# ----------------------------------------------------------------------------- finish_together
class Sleeper:
    """A tiny worker: `work` sleeps, then returns its rank or raises."""

    def __init__(self, rank, world, log_path):
        from megatron_agent.train.cluster import redirect_output

        redirect_output(log_path)
        self.rank = rank

    def work(self, seconds: float, fail: bool = False) -> int:
        print(f"rank {self.rank} works {seconds} s", flush=True)
        time.sleep(seconds)
        if fail:
            raise ValueError(f"rank {self.rank} ran out of tasks")
        return self.rank


@pytest.fixture
def groups(cluster, tmp_path):
    """make(name, num_workers, timeout_s): `Sleeper` groups, started and killed at the end."""
    made = []

    def make(name: str, num_workers: int, timeout_s: float = 60.0) -> WorkerGroup:
        group = WorkerGroup(
            Sleeper, num_workers, name=name, log_dir=tmp_path, num_cpus=0, timeout_s=timeout_s
        )
        made.append(group)
        group.call("work", 0)  # constructed: the timings below are the calls'
        return group

    yield make
    for group in made:
        group.kill()


def test_finish_together_returns_when_each_group_finished(groups):
    fast, slow = groups("fast", 2), groups("slow", 1)
    calls = {"fast": fast.submit("work", 0.0), "slow": slow.submit("work", 3.0)}
    begin = time.perf_counter()
    done = finish_together(calls)
    end = time.perf_counter()
    assert set(done) == {"fast", "slow"}
    assert begin < done["fast"] < done["slow"] <= end
    assert done["slow"] - done["fast"] > 1.5, done  # the fast group's time is its own
    assert done["slow"] - begin >= 2.9
    assert calls["fast"].result() == [0, 1] and calls["slow"].result() == [0]


def test_finish_together_raises_the_first_failure_naming_its_worker(groups):
    busy, failing = groups("busy", 1), groups("failing", 2)
    calls = {
        "busy": busy.submit("work", 60.0),
        "failing": failing.submit("work", per_worker_args=[(60.0,), (0.5, True)]),
    }
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        finish_together(calls)
    assert time.monotonic() - start < 20  # not after the others finish
    text = str(err.value)
    assert "failing worker rank 1 raised in work()" in text and "rank 1 ran out of tasks" in text, text
    assert "rank 1 works 0.5 s" in text  # the tail of its log


def test_finish_together_names_the_late_rank(groups):
    fine, late = groups("fine", 1, timeout_s=3), groups("late", 2, timeout_s=3)
    calls = {"fine": fine.submit("work", 0.0), "late": late.submit("work", per_worker_args=[(0.0,), (60.0,)])}
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        finish_together(calls)
    assert 2.5 < time.monotonic() - start < 20
    text = str(err.value)
    assert "late worker rank 1 did not finish work() within 3 s" in text, text
    assert "late worker rank 0" not in text


def test_finish_together_holds_each_group_to_its_own_timeout(groups):
    # The docstring: "not to finish within its group's timeout" raises. A late group with a short
    # timeout is named then, not when a finished group's longer timeout runs out.
    fine, late = groups("fine", 1, timeout_s=25), groups("late", 1, timeout_s=3)
    calls = {"fine": fine.submit("work", 0.0), "late": late.submit("work", 60.0)}
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        finish_together(calls)
    elapsed = time.monotonic() - start
    assert "late worker rank 0 did not finish work()" in str(err.value)
    assert elapsed < 15, f"named after {elapsed:.0f} s; the late group's timeout is 3 s, the other's 25 s"


# ----------------------------------------------------------------------------- StartupClock
def test_a_process_start_time_is_between_its_launch_and_its_first_line():
    # psutil's create_time() rounds the boot time down to a second: up to 1 s early, which this
    # bound catches wherever the rounding is larger than the 10 ms clock ticks.
    code = "import time\nfrom megatron_agent.train.startup import process_age\nprint(time.time() - process_age())"
    for _ in range(3):
        launched = time.time()
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
        )
        done = time.time()
        started = float(out.stdout)
        assert launched - 0.02 <= started <= done, (launched, started, done)


def test_startup_clock_metrics_and_line_with_concurrent_phases():
    from megatron_agent.train.startup import StartupClock, process_age

    clock = StartupClock()
    clock.add("inputs", 2.2)
    clock.add("ray", 3.1)  # concurrent with inputs
    with clock.phase("wait_ray"):
        time.sleep(0.05)
    clock.add("workers", 11.2)
    clock.add("megatron", 5.7)  # the two kinds concurrent with each other, within workers
    clock.add("engines", 11.24)
    clock.add("first_sync", 0.1)
    clock.add("first_sync", 0.15)  # a repeated phase adds up
    metrics = clock.metrics()
    names = ["inputs", "ray", "wait_ray", "workers", "megatron", "engines", "first_sync", "total"]
    assert set(metrics) == {f"timing_s/startup/{name}" for name in names}
    assert metrics["timing_s/startup/first_sync"] == pytest.approx(0.25)
    assert 0.05 <= metrics["timing_s/startup/wait_ray"] < 2
    # total: from the process's start (interpreter and imports included), until now
    since_start = process_age()
    assert metrics["timing_s/startup/total"] == pytest.approx(since_start, abs=0.5)
    assert metrics["timing_s/startup/total"] > metrics["timing_s/startup/wait_ray"]

    line = clock.line()
    expected = (
        r"start-up: (\d+\.\d) s to the first step \(inputs 2\.2 \[ray 3\.1 in the background\], "
        r"wait_ray 0\.\d, workers 11\.2 \[megatron 5\.7 \| engines 11\.2, concurrently\], first_sync 0\.2\)"
    )
    found = re.fullmatch(expected, line)
    assert found, line
    assert float(found.group(1)) == pytest.approx(since_start, abs=0.5)


def test_the_startup_total_ignores_a_step_of_the_wall_clock(monkeypatch):
    # A run's start-up once read 29.7 s where its phases added up to 13.8 s: the total was the wall
    # clock now minus the wall-clock start, so a step of the wall clock (NTP, a virtual machine
    # resumed) counted as start-up. It is measured on perf_counter now.
    from megatron_agent.train import startup

    clock = startup.StartupClock()
    before = clock.total()
    real = time.time
    monkeypatch.setattr(startup.time, "time", lambda: real() + 100.0)
    after = clock.total()
    monkeypatch.undo()
    assert 0.0 <= after - before < 1.0, (before, after)
    assert before == pytest.approx(startup.process_age(), abs=0.5)


# ----------------------------------------------------------------------------- TreeMemory
# A child that starts a grandchild holding 200 MB of written (resident) memory, then says "ready".
HOLDER = "import sys, time; block = b'x' * (200 << 20); print('ready', flush=True); time.sleep(120)"
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {HOLDER!r}])"


def test_tree_memory_counts_a_grandchild_s_memory():
    from megatron_agent.platform.tree_memory import TreeMemory, tree_usage

    rss_before, pss_before, _ = tree_usage()
    memory = TreeMemory(interval_s=0.1).start()
    child = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        rss_now, _, num_now = tree_usage()
        time.sleep(0.5)  # a few samples while the grandchild holds its block
        metrics = memory.stop()
    finally:
        for process in psutil.Process(child.pid).children(recursive=True):
            process.kill()
        child.kill()
        child.wait()
    assert num_now >= 3  # this process, the child and the grandchild
    assert rss_now - rss_before >= 150e6, (rss_before, rss_now)
    assert metrics["perf/peak_rss_sum_gb"] - rss_before / 1e9 >= 0.15, (rss_before, metrics)
    assert metrics["perf/peak_pss_sum_gb"] - pss_before / 1e9 >= 0.15, (pss_before, metrics)
    assert metrics["perf/peak_processes"] >= 3


def test_tree_memory_reads_the_costly_pss_only_at_new_peaks_when_due_and_at_the_end():
    from megatron_agent.platform.tree_memory import TreeMemory

    memory = TreeMemory(interval_s=3600, pss_interval_s=0.3)  # sampled by hand below
    memory.sample()  # the first: PSS read
    for _ in range(5):  # the same tree, no new peak, not due: RSS only
        memory.sample()
    assert (memory.num_samples, memory.num_pss_reads) == (6, 1)
    peak_pss = memory.peak_pss
    assert peak_pss > 0
    block = bytearray(100 << 20)  # a new RSS peak: PSS read at once
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    memory.sample()
    assert memory.num_pss_reads == 2 and memory.peak_pss >= peak_pss + 90e6
    del block
    time.sleep(0.35)  # due
    memory.sample()
    assert memory.num_pss_reads == 3
    memory.sample(pss=True)  # the last sample (`stop`) always reads it
    assert (memory.num_samples, memory.num_pss_reads) == (9, 4)
