"""The raylet's dashboard agent in a lean local cluster: the stand-in writes "no service" into the
port files the raylet waits for and ends with its parent; `with_dashboard_agent_stand_in` gives it
to the raylet's command line. (tests/train/test_lean_cluster.py runs a real cluster with it.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil

from megatron_agent.train.cluster import DASHBOARD_AGENT_STAND_IN, with_dashboard_agent_stand_in

NODE_ID = "ab" * 28

# A parent that starts the stand-in, reports its pid, and exits when told to (a line on stdin).
PARENT = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-S", "-I", *sys.argv[1:]])
    print(child.pid, flush=True)
    sys.stdin.readline()
    """
)


def test_the_stand_in_writes_unused_ports_and_ends_with_its_parent(tmp_path):
    files = [tmp_path / "metrics_agent_port_x", tmp_path / "dashboard_agent_listen_port_x"]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(DASHBOARD_AGENT_STAND_IN), *map(str, files)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stand_in = psutil.Process(int(parent.stdout.readline()))
    deadline = time.monotonic() + 20
    while not all(f.exists() for f in files):
        assert time.monotonic() < deadline, "the stand-in wrote no port file"
        time.sleep(0.05)
    assert [f.read_text() for f in files] == ["-1", "-1"]
    assert not list(tmp_path.glob("*.tmp"))  # written by rename: the raylet never reads half a file
    assert stand_in.is_running() and stand_in.memory_info().rss < 30 * 2**20
    time.sleep(1.5)
    assert stand_in.is_running()  # it waits while its parent (the raylet) lives
    parent.communicate("exit\n", timeout=20)
    stand_in.wait(timeout=10)  # and ends within a second or two of it


def test_the_raylet_command_gets_the_stand_in_with_its_port_files():
    from ray._raylet import (
        DASHBOARD_AGENT_LISTEN_PORT_NAME,
        METRICS_AGENT_PORT_NAME,
        METRICS_EXPORT_PORT_NAME,
        get_port_filename,
    )

    command = [
        "/x/raylet",
        f"--node_id={NODE_ID}",
        "--session_dir=/tmp/ray/session_1",
        "--runtime_env_agent_command=/usr/bin/python agent/main.py --a=1",
        "--dashboard_agent_command=/usr/bin/python dashboard/agent.py --b=2",
        "--static_resource_list=CPU,2",
    ]
    rewritten = with_dashboard_agent_stand_in(command)
    assert [a for a in rewritten if not a.startswith("--dashboard_agent_command=")] == [
        a for a in command if not a.startswith("--dashboard_agent_command=")
    ]
    (agent,) = [a for a in rewritten if a.startswith("--dashboard_agent_command=")]
    ports = [
        f"/tmp/ray/session_1/{get_port_filename(NODE_ID, name)}"
        for name in (METRICS_AGENT_PORT_NAME, METRICS_EXPORT_PORT_NAME, DASHBOARD_AGENT_LISTEN_PORT_NAME)
    ]
    expected = subprocess.list2cmdline([sys.executable, "-S", "-I", str(DASHBOARD_AGENT_STAND_IN), *ports])
    assert agent == f"--dashboard_agent_command={expected}"


def test_a_raylet_command_without_the_known_flags_is_left_as_it_is():
    command = ["/x/raylet", "--session_dir=/tmp/s", "--dashboard_agent_command=python agent.py"]
    assert with_dashboard_agent_stand_in(command) == command  # no --node_id: another Ray
