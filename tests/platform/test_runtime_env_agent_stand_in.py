"""The raylet's runtime-env agent in a lean local cluster: the stand-in answers Ray's protobuf
requests as Ray's agent does for runtime environments of variables only (checked against Ray's
generated messages and its own context), refuses every other field by name, serves HTTP on the
port it writes and ends with its parent; `with_runtime_env_agent_stand_in` gives it to the
raylet's command line. (tests/train/test_lean_cluster.py runs a real cluster with it.)"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from ray._private.runtime_env.context import RuntimeEnvContext
from ray.core.generated import runtime_env_agent_pb2 as pb

from megatron_agent.platform import runtime_env_agent_stand_in as agent
from megatron_agent.train.cluster import RUNTIME_ENV_AGENT_STAND_IN, with_runtime_env_agent_stand_in

NODE_ID = "cd" * 28

PARENT = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-S", "-I", *sys.argv[1:]])
    print(child.pid, flush=True)
    sys.stdin.readline()
    """
)


def create(serialized_runtime_env: str, **fields) -> pb.GetOrCreateRuntimeEnvReply:
    """The stand-in's reply to a GetOrCreateRuntimeEnvRequest as the raylet sends it."""
    request = pb.GetOrCreateRuntimeEnvRequest(
        serialized_runtime_env=serialized_runtime_env,
        job_id=b"\x01\x00\x00\x00",
        source_process="raylet",
        **fields,
    )
    reply = pb.GetOrCreateRuntimeEnvReply()
    reply.ParseFromString(agent.answer("/get_or_create_runtime_env", request.SerializeToString()))
    return reply


def test_variables_get_the_context_rays_agent_makes():
    env_vars = {"OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "EMPTY": ""}
    reply = create(json.dumps({"env_vars": env_vars}))
    assert reply.status == pb.AGENT_RPC_STATUS_OK and reply.error_message == ""
    assert json.loads(reply.serialized_runtime_env_context) == json.loads(
        RuntimeEnvContext(env_vars=env_vars).serialize()
    )
    # the setup's config (timeout, log files) changes nothing here; no runtime environment at all
    config = pb.GetOrCreateRuntimeEnvRequest().runtime_env_config.__class__(setup_timeout_seconds=30)
    assert (
        create(
            json.dumps({"env_vars": env_vars, "config": {"setup_timeout_seconds": 30}}),
            runtime_env_config=config,
        ).status
        == 0
    )
    for empty in ("", "{}"):
        assert json.loads(create(empty).serialized_runtime_env_context) == json.loads(
            RuntimeEnvContext().serialize()
        )


@pytest.mark.parametrize(
    "runtime_env, named",
    [
        ({"pip": ["requests"]}, "['pip']"),
        ({"env_vars": {"A": "1"}, "working_dir": ".", "py_modules": ["x"]}, "['py_modules', 'working_dir']"),
        ({"env_vars": {"A": 1}}, "env_vars must map names to strings"),
        ([], "not a JSON object"),
    ],
)
def test_anything_else_is_refused_with_what_it_was(runtime_env, named):
    reply = create(json.dumps(runtime_env))
    assert reply.status == pb.AGENT_RPC_STATUS_FAILED and named in reply.error_message
    assert reply.serialized_runtime_env_context == ""
    assert "not JSON" in create("{").error_message


def test_delete_and_info_answer_as_for_nothing_installed():
    request = pb.DeleteRuntimeEnvIfPossibleRequest(
        serialized_runtime_env='{"env_vars": {}}', source_process="raylet"
    )
    reply = pb.DeleteRuntimeEnvIfPossibleReply()
    reply.ParseFromString(agent.answer("/delete_runtime_env_if_possible", request.SerializeToString()))
    assert reply.status == pb.AGENT_RPC_STATUS_OK
    info = pb.GetRuntimeEnvsInfoReply()
    info.ParseFromString(
        agent.answer("/get_runtime_envs_info", pb.GetRuntimeEnvsInfoRequest(limit=5).SerializeToString())
    )
    assert list(info.runtime_env_states) == [] and info.total == 0
    assert agent.answer("/unknown", b"") is None


def test_the_wire_format_round_trips_against_protobuf():
    long_text = "x" * 300  # a two-byte length
    reply = pb.GetOrCreateRuntimeEnvReply(
        status=1, error_message=long_text, serialized_runtime_env_context="é"
    )
    assert agent.encode_fields([(1, 1), (2, long_text), (3, "é")]) == reply.SerializeToString()
    request = pb.GetOrCreateRuntimeEnvRequest(
        serialized_runtime_env=long_text, job_id=b"\x00\xff", source_process="p"
    )
    fields = agent.decode_fields(request.SerializeToString())
    assert fields[1] == long_text.encode() and fields[3] == b"\x00\xff" and fields[4] == b"p"
    for broken in (b"\x0a\x05ab", b"\x08\xff", b"\x0f"):  # short field, short varint, wire type 7
        with pytest.raises(ValueError):
            agent.decode_fields(broken)


def test_the_stand_in_serves_on_the_port_it_writes_and_ends_with_its_parent(tmp_path):
    port_file = tmp_path / "runtime_env_agent_port_x"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(RUNTIME_ENV_AGENT_STAND_IN), "127.0.0.1", "0", str(port_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stand_in = psutil.Process(int(parent.stdout.readline()))
    deadline = time.monotonic() + 20
    while not port_file.exists():
        assert time.monotonic() < deadline, "the stand-in wrote no port file"
        time.sleep(0.02)
    assert not list(tmp_path.glob("*.tmp"))
    connection = http.client.HTTPConnection("127.0.0.1", int(port_file.read_text()), timeout=10)
    body = pb.GetOrCreateRuntimeEnvRequest(
        serialized_runtime_env='{"env_vars": {"A": "b"}}'
    ).SerializeToString()
    for _ in range(2):  # one kept connection, as the raylet's client keeps it
        connection.request("POST", "/get_or_create_runtime_env", body=body)
        response = connection.getresponse()
        reply = pb.GetOrCreateRuntimeEnvReply()
        reply.ParseFromString(response.read())
        assert response.status == 200 and json.loads(reply.serialized_runtime_env_context)["env_vars"] == {
            "A": "b"
        }
    # a body sent in chunks is read whole (not taken for an empty runtime environment)
    connection.request(
        "POST", "/get_or_create_runtime_env", body=iter([body[:7], body[7:]]), encode_chunked=True
    )
    reply = pb.GetOrCreateRuntimeEnvReply()
    reply.ParseFromString(connection.getresponse().read())
    assert json.loads(reply.serialized_runtime_env_context)["env_vars"] == {"A": "b"}
    connection.request("POST", "/get_or_create_runtime_env", body=b"\x0a\x05ab")
    assert connection.getresponse().status == 400
    assert stand_in.memory_info().rss < 30 * 2**20
    parent.communicate("exit\n", timeout=20)
    stand_in.wait(timeout=10)


def test_the_raylet_command_gets_the_stand_in_on_the_agents_address():
    from ray._raylet import RUNTIME_ENV_AGENT_PORT_NAME, get_port_filename

    ray_agent = subprocess.list2cmdline(
        [
            "/py",
            "/ray/_private/runtime_env/agent/main.py",
            f"--node-id={NODE_ID}",
            "--node-ip-address=10.1.2.3",
            "--runtime-env-agent-port=0",
            "--session-dir=/tmp/s",
            "--logging-format=%(asctime)s a format with spaces",
        ]
    )
    command = ["/x/raylet", f"--node_id={NODE_ID}", f"--runtime_env_agent_command={ray_agent}", "--z=1"]
    rewritten = with_runtime_env_agent_stand_in(command)
    assert rewritten[0] == "/x/raylet" and rewritten[1] == command[1] and rewritten[3] == "--z=1"
    port_file = f"/tmp/s/{get_port_filename(NODE_ID, RUNTIME_ENV_AGENT_PORT_NAME)}"
    assert rewritten[2] == "--runtime_env_agent_command=" + subprocess.list2cmdline(
        [sys.executable, "-S", "-I", str(RUNTIME_ENV_AGENT_STAND_IN), "10.1.2.3", "0", port_file]
    )
    # another Ray's agent flags, or none: left as it is
    other = ["/x/raylet", "--runtime_env_agent_command=/py main.py --port=1"]
    assert with_runtime_env_agent_stand_in(other) == other
    assert with_runtime_env_agent_stand_in(["/x/raylet"]) == ["/x/raylet"]
