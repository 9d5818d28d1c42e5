"""What the raylet of a lean local cluster starts in place of Ray's runtime-env agent.

Before a worker starts, the raylet asks its runtime-env agent (HTTP POSTs carrying protobuf
messages) to prepare the worker's runtime environment, and gets back a context (JSON: the
variables to set, the Python to run, a command prefix, ...) that the worker's setup script applies
(`platform/setup_worker_stand_in.py`). A run's runtime environments only ever carry environment
variables (`train/cluster.py`: the driver's and every worker group's `env_vars`), for which Ray's
agent makes the context `{"env_vars": ...}` and prepares nothing. Ray's agent imports Ray and
aiohttp first (0.5 s of CPU), and the raylet registers its node only once the agent has written
its port: that import was most of a local cluster's start, on the cores the driver's own start
uses. This stand-in answers with the standard library at once (about 10 MB resident against the
agent's 120 MB):

- `/get_or_create_runtime_env`: the context Ray's agent makes for a runtime environment with
  environment variables only (and its `config`, the setup's timeout and logs, which it does not
  need); any other field (pip, conda, uv, working_dir, py_modules, container, ...) is refused with
  an error naming the field, which the raylet raises in the driver (a cluster of Ray's own,
  joined with `ray.address`, serves them);
- `/delete_runtime_env_if_possible`: nothing to delete, OK;
- `/get_runtime_envs_info`: no runtime environments (nothing is installed).

It binds the address and port Ray's agent would (port 0: any free port), writes the port into the
file the raylet waits for, and ends when its parent (the raylet) is gone or on SIGTERM.

    python -S -I runtime_env_agent_stand_in.py HOST PORT PORT_FILE   (what train/cluster.py gives the raylet)

Standard library only: it runs isolated from the project and its environment.
"""

import http.server
import json
import os
import socket
import sys
import threading
import time

STATUS_OK, STATUS_FAILED = 0, 1  # Ray's AgentRpcStatus
ENV_ONLY_FIELDS = {"env_vars", "config"}
"""The fields of a runtime environment this stand-in serves (every other one is refused)."""


# ----------------------------------------------------------------------------- protobuf wire format
def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def decode_fields(data: bytes) -> dict[int, bytes | int]:
    """The fields of a protobuf message: number -> value (bytes for length-delimited fields, int
    for varints; the last occurrence wins, as protobuf's own parser has it for scalars)."""
    fields: dict[int, bytes | int] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            fields[number], pos = _varint(data, pos)
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ValueError("truncated field")
            fields[number], pos = data[pos : pos + length], pos + length
        elif wire_type in (1, 5):  # fixed 64 / 32 bits: none in these messages, skipped
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"wire type {wire_type}")
    return fields


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_fields(fields: list[tuple[int, int | str]]) -> bytes:
    """A protobuf message of (number, int | str) fields; defaults (0, '') are left out, as
    protobuf writes them."""
    out = bytearray()
    for number, value in fields:
        if isinstance(value, int):
            if value:
                out += _encode_varint(number << 3) + _encode_varint(value)
        elif value:
            raw = value.encode()
            out += _encode_varint(number << 3 | 2) + _encode_varint(len(raw)) + raw
    return bytes(out)


# ----------------------------------------------------------------------------- the answers
def runtime_env_context(serialized_runtime_env: str) -> tuple[str, str]:
    """(the serialized context, '') for a runtime environment of variables only, as Ray's agent
    makes it; ('', the error) for anything else."""
    try:
        runtime_env = json.loads(serialized_runtime_env or "{}")
    except ValueError as exc:
        return "", f"the runtime environment is not JSON: {exc}"
    if not isinstance(runtime_env, dict):
        return "", "the runtime environment is not a JSON object"
    others = sorted(
        name
        for name, value in runtime_env.items()
        if name not in ENV_ONLY_FIELDS and not name.startswith("_") and value  # "_ray_commit": Ray's note
    )
    if others:
        return "", (
            f"runtime_env fields {others} are not served by a lean local Ray cluster, whose "
            "runtime-env agent sets environment variables only (join a cluster of Ray's own with ray.address)"
        )
    env_vars = runtime_env.get("env_vars") or {}
    if not isinstance(env_vars, dict) or not all(isinstance(v, str) for v in env_vars.values()):
        return "", "runtime_env env_vars must map names to strings"
    context = {
        "command_prefix": [],
        "env_vars": env_vars,
        "py_executable": sys.executable,
        "override_worker_entrypoint": None,
        "java_jars": [],
    }
    return json.dumps(context), ""


def answer(path: str, body: bytes) -> bytes | None:
    """The reply to a POST of `body` to `path`; None for a path Ray's agent does not serve."""
    if path == "/get_or_create_runtime_env":
        request = decode_fields(body)
        context, error = runtime_env_context(bytes(request.get(1, b"")).decode())
        status = STATUS_FAILED if error else STATUS_OK
        return encode_fields([(1, status), (2, error), (3, context)])
    if path == "/delete_runtime_env_if_possible":
        decode_fields(body)
        return encode_fields([(1, STATUS_OK)])
    if path == "/get_runtime_envs_info":
        decode_fields(body)
        return b""  # no runtime environments, total 0
    return None


class Handler(http.server.BaseHTTPRequestHandler):
    """POSTs from the raylet, answered by `answer`."""

    protocol_version = "HTTP/1.1"  # the raylet's client keeps its connection

    def do_POST(self):  # noqa: N802 - http.server's name
        try:
            reply = answer(self.path, self.read_body())
        except ValueError as exc:
            self.send_error(400, f"not a protobuf message: {exc}")
            return
        if reply is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def read_body(self) -> bytes:
        """The request's body, sent with a length or in chunks."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            body = bytearray()
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                body += self.rfile.read(size)
                self.rfile.readline()  # the chunk's CRLF
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return bytes(body)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def log_message(self, *args):
        """Quiet: the raylet logs its own requests."""


def write_port(path: str, port: int) -> None:
    """Write `port` to `path` atomically (the raylet polls for the file)."""
    staging = f"{path}.{os.getpid()}.tmp"
    with open(staging, "w") as f:
        f.write(str(port))
    os.replace(staging, path)


def main(argv: list[str]) -> int:
    """Serve on HOST:PORT, write the bound port to PORT_FILE, end with the parent process."""
    host, port, port_file = argv[0], int(argv[1]), argv[2]
    parent = os.getppid()
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]

    class Server(http.server.ThreadingHTTPServer):
        address_family = family
        daemon_threads = True

    server = Server(address, Handler)
    write_port(port_file, server.server_address[1])
    threading.Thread(target=server.serve_forever, name="serve", daemon=True).start()
    while os.getppid() == parent:
        time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
