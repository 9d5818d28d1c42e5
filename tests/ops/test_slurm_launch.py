"""examples/slurm/ray_launch.sh run for real on this machine against fake `scontrol` and `srun`.

Two "nodes" (ranode1, ranode2) are two real `ray start` processes here, each with its own ports
and temp folder; the driver is a real Ray client. Every process the test starts is stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.ops.fake_slurm import install_fakes

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "examples" / "slurm" / "ray_launch.sh"
DRIVER = Path(__file__).with_name("ray_driver.py")
PORT_NAMES = (
    "RAY_NODE_MANAGER_PORT",
    "RAY_OBJECT_MANAGER_PORT",
    "RAY_CLIENT_SERVER_PORT",
    "RAY_DASHBOARD_AGENT_LISTEN_PORT",
    "RAY_DASHBOARD_AGENT_GRPC_PORT",
    "RAY_METRICS_EXPORT_PORT",
    "RAY_RUNTIME_ENV_AGENT_PORT",
)


def _free_block(size: int) -> int:
    """First port of `size` consecutive ports that are free now (searched from a random start)."""
    rng = int.from_bytes(os.urandom(2), "little")
    for _ in range(200):
        base = 20000 + (rng % 400) * 50
        rng += 7
        try:
            for port in range(base, base + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports")


def _processes_with(token: str) -> list[int]:
    """Pids of processes whose command line contains `token` (the test's own temp folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if token in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


class Job:
    """One launcher run with its fakes, ports, folders, and the cleanup of what it started."""

    def __init__(self, tmp_path: Path, wait_signal: float, driver_args: tuple[str, ...] = ()):
        self.token = tempfile.mkdtemp(prefix="mops", dir="/tmp")  # short: Ray's socket paths are capped
        self.out = tmp_path / "driver.json"
        self.slurm_log = tmp_path / "slurm.jsonl"
        bin_dir = install_fakes(tmp_path / "bin", sys.executable)
        base = _free_block(2 * 10 + 2 * 40)
        node_env = {}
        for i, node in enumerate(("ranode1", "ranode2")):
            first = base + 2 + i * 10
            env = {name: str(first + j) for j, name in enumerate(PORT_NAMES)}
            env["RAY_MIN_WORKER_PORT"] = str(base + 20 + i * 40)
            env["RAY_MAX_WORKER_PORT"] = str(base + 20 + i * 40 + 39)
            env["RAY_TMP_DIR"] = f"{self.token}/{i}"
            node_env[node] = env
        self.env = dict(
            os.environ,
            PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            PYTHONPATH=str(REPO),
            FAKE_SLURM_LOG=str(self.slurm_log),
            FAKE_SLURM_NODE_ENV=json.dumps(node_env),
            SLURM_JOB_ID="4242",
            SLURM_JOB_NODELIST="ranode[1-2]",
            RAY_PORT=str(base),
            RAY_DASHBOARD="0",
            RAY_NUM_CPUS="1",
            GPUS_PER_NODE="0",
            RAY_JOIN_TIMEOUT_S="90",
            STOP_GRACE_S="15",
            NET_IFNAME="lo",
            SHARED_CACHE=str(tmp_path / "cache"),
            CONTAINER_IMAGE="/images/megatron-agent.sqsh",
            LOG_DIR=str(tmp_path / "logs"),
            OMP_NUM_THREADS="1",
        )
        self.port = base
        cmd = ["bash", str(LAUNCH), sys.executable, str(DRIVER), "ray.address={RAY_ADDRESS}"]
        cmd += ["--out", str(self.out), "--wait-signal", str(wait_signal), *driver_args]
        self.proc = subprocess.Popen(
            cmd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def wait_for_driver(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while not self.out.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"launcher ended early ({self.proc.returncode}):\n{self.proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail("the driver did not start in time")
            time.sleep(0.5)
        return json.loads(self.out.read_text())

    def finish(self, timeout: float = 60) -> tuple[int, str, float]:
        start = time.monotonic()
        output, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, output, time.monotonic() - start

    def slurm_calls(self) -> list[dict]:
        return [json.loads(line) for line in self.slurm_log.read_text().splitlines()]

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in _processes_with(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.token, ignore_errors=True)


def _wait_gone(token: str, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _processes_with(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_launch_runs_driver_on_joined_cluster_then_requeues_and_stops(tmp_path):
    job = Job(tmp_path, wait_signal=60)
    try:
        report = job.wait_for_driver()
        assert report["address"] == f"127.0.0.1:{job.port}"
        assert report["nodes"] == 2  # the driver starts only after both nodes joined
        assert report["env"]["NCCL_SOCKET_IFNAME"] == "lo" and report["env"]["GLOO_SOCKET_IFNAME"] == "lo"
        assert report["env"]["HF_HOME"] == str(tmp_path / "cache" / "hf")
        assert report["env"]["RAY_ADDRESS"] == report["address"]
        assert len(_processes_with(job.token)) >= 4  # two `ray start` plus their raylets at least
        os.kill(job.proc.pid, signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@...` does
        rc, output, _ = job.finish()
        assert rc == 0, output
        assert json.loads(job.out.read_text()).get("checkpointed") is True
        calls = job.slurm_calls()
        assert {"cmd": "scontrol", "argv": ["show", "hostnames", "ranode[1-2]"]} in calls
        assert {"cmd": "scontrol", "argv": ["requeue", "4242"]} in calls
        steps = [c for c in calls if c["cmd"] == "srun"]
        assert {c["node"] for c in steps} == {"ranode1", "ranode2"}
        assert all(c["opts"]["--container-image"] == "/images/megatron-agent.sqsh" for c in steps)
        driver = [c for c in steps if str(DRIVER) in c["argv"]]
        assert len(driver) == 1 and driver[0]["node"] == "ranode1"
        # Every node checked the python tool's sandbox with the driver's overrides, before Ray.
        checks = [c for c in steps if "check-sandbox" in c["argv"]]
        assert sorted(c["node"] for c in checks) == ["ranode1", "ranode2"]
        assert all(c["argv"][-1] == f"ray.address=127.0.0.1:{job.port}" for c in checks)
        first_node = next(i for i, c in enumerate(steps) if "_node" in c["argv"])
        assert all(steps.index(c) < first_node for c in checks)
        assert "ranode2: sandbox on" in output
        assert f"ray.address=127.0.0.1:{job.port}" in driver[0]["argv"]
        assert _wait_gone(job.token) == [], "Ray processes survived the job"
        assert "cluster stopped" in output
    finally:
        job.cleanup()


def test_dead_worker_fails_the_job_fast(tmp_path):
    job = Job(tmp_path, wait_signal=300)
    try:
        report = job.wait_for_driver()
        worker_dir = f"{job.token}/1"
        raylets = [
            p for p in _processes_with(worker_dir) if b"raylet" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert raylets, "no raylet of the worker node found"
        for pid in raylets:
            os.kill(pid, signal.SIGKILL)
        rc, output, seconds = job.finish(timeout=60)
        assert rc != 0
        assert "worker on ranode2 exited" in output, output
        assert seconds < 30, f"the job took {seconds:.0f}s to fail"
        assert _wait_gone(job.token) == [], "Ray processes survived the failed job"
        with pytest.raises(ProcessLookupError):
            os.kill(report["pid"], 0)  # the driver was stopped too
    finally:
        job.cleanup()


def test_a_node_whose_sandbox_cannot_hold_the_runs_calls_fails_the_job_before_ray(tmp_path):
    # The run asks for more sandboxed memory than any machine has: refused on every node.
    too_much = ("tools.enabled=[python]", "tools.max_concurrent=1000", "tools.python.memory_mb=65536")
    job = Job(tmp_path, wait_signal=60, driver_args=too_much)
    try:
        rc, output, seconds = job.finish(timeout=90)
        assert rc != 0 and "sandbox cannot hold a call on" in output, output
        assert "ranode1: error: tools.max_concurrent=1000 x tools.python.memory_mb=65536" in output, output
        assert not [c for c in job.slurm_calls() if "_node" in c.get("argv", [])], "Ray started"
        assert not job.out.exists()
    finally:
        job.cleanup()
