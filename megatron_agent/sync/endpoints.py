"""Engine endpoints: one interface, `call(method, *args, **kwargs) -> EngineCall`, over any RPC.

`EngineCall.result(timeout)` returns the receiver's answer or raises `SyncError` naming the
engine: on an error inside it, when its process died (pid and exit code), or when it did not
answer within the timeout. Endpoints carry control messages and bucket *descriptions* only (a
header and a shared-memory name or CUDA handle), never tensors one at a time.

- `LocalEndpoint(receiver)`: the engine in this process; direct calls.
- `SubprocessEndpoint(model_path, engine_kwargs)`: starts a spawned process that builds a
  `VLLMEngine` and a `WeightReceiver` and serves calls over a local socket; other processes
  (the actor's other pipeline-stage senders) attach with `SubprocessEndpoint.connect(handle)`.
- `RayEndpoint(actor)`: an engine in a Ray actor exposing `sync_call(method, *args, **kwargs)`.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from megatron_agent.sync.buckets import SyncError

_POLL_S = 0.2


class EngineCall:
    """The pending answer of one engine call."""

    def __init__(self, future: Future, describe, method: str, liveness=None):
        self._future = future
        self._describe = describe
        self._method = method
        self._liveness = liveness

    def result(self, timeout: float | None = None) -> Any:
        """The answer; SyncError on an engine error, a dead engine, or no answer within `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            try:
                return self._future.result(step)
            except FutureTimeout:
                pass
            if self._liveness is not None:
                dead = self._liveness()
                if dead:
                    raise SyncError(f"{self._describe()} died during {self._method!r}: {dead}")
            if deadline is not None and time.monotonic() >= deadline:
                raise SyncError(
                    f"{self._describe()} did not answer {self._method!r} within {timeout:.0f} s "
                    "(hung or stopped; raise sync.timeout_s if it is only slow)"
                )

    def done(self) -> bool:
        """Whether the answer (or an error) is there."""
        return self._future.done()


def _done(value=None, error: BaseException | None = None) -> Future:
    f: Future = Future()
    if error is None:
        f.set_result(value)
    else:
        f.set_exception(error)
    return f


def _as_sync_error(where: str, method: str, e: BaseException) -> SyncError:
    if isinstance(e, SyncError):
        return e
    return SyncError(f"{where}: {method!r} failed: {type(e).__name__}: {e}")


class LocalEndpoint:
    """An engine in this process: calls go straight to its `WeightReceiver`."""

    local = True

    def __init__(self, receiver, name: str = "local engine"):
        self.receiver = receiver
        self.name = name

    def call(self, method: str, *args, **kwargs) -> EngineCall:
        """Run `receiver.handle(method, ...)` now; the answer (or error) is in the returned call."""
        try:
            f = _done(self.receiver.handle(method, *args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - delivered through the call, like a remote error
            f = _done(error=_as_sync_error(self.name, method, e))
        return EngineCall(f, lambda: self.name, method)


class SubprocessEndpoint:
    """A vLLM engine in its own spawned process, served over a local (AF_UNIX) socket.

    `engine_class` ('module:Class', built as Class(model_path, **engine_kwargs)) may name another
    engine with the same update API. The process that constructs it owns the engine (`close()` stops it); `handle` is a small
    picklable dict another process passes to `SubprocessEndpoint.connect` to call the same engine.
    """

    local = False

    def __init__(
        self,
        model_path: str | os.PathLike,
        engine_kwargs: dict | None = None,
        *,
        env: dict[str, str] | None = None,
        name: str = "engine",
        start_timeout_s: float = 600.0,
        engine_class: str = "megatron_agent.rollout.engine:VLLMEngine",
    ):
        import multiprocessing as mp

        from megatron_agent.rollout.engine_env import engine_process_env
        from megatron_agent.sync.server import serve_engine

        self._dir = tempfile.mkdtemp(prefix="megatron-agent-engine-")
        address = os.path.join(self._dir, "engine.sock")
        authkey = os.urandom(16)
        ctx = mp.get_context("spawn")
        self.process = ctx.Process(
            target=serve_engine,
            args=(
                address,
                authkey,
                engine_class,
                str(model_path),
                dict(engine_kwargs or {}),
                os.getpid(),
            ),
            name=name,
        )
        # The engine's environment is set from its start (glibc reads its tunables at exec, torch
        # and vLLM their settings at import): the spawned interpreter inherits os.environ.
        with _exported({**engine_process_env(), **(env or {})}):
            self.process.start()
        self.handle = {"address": address, "authkey": authkey, "pid": self.process.pid, "name": name}
        deadline = time.monotonic() + start_timeout_s
        ready = address + ".ready"
        while not os.path.exists(ready):
            if self.process.exitcode is not None:
                raise SyncError(
                    f"engine process {name} (pid {self.process.pid}) exited with code "
                    f"{self.process.exitcode} while starting; its stderr has the cause"
                )
            if time.monotonic() > deadline:
                self.process.kill()
                raise SyncError(
                    f"engine process {name} (pid {self.process.pid}) did not start in {start_timeout_s:.0f} s"
                )
            time.sleep(0.1)
        self._client = _Client(self.handle, self.process)
        # multiprocessing joins live children at interpreter exit, and the engine waits for its
        # owner to exit: stop it first (atexit runs this before multiprocessing's own handler).
        atexit.register(self.close)

    @classmethod
    def connect(cls, handle: dict) -> _Client:
        """Attach to an engine another process started (from its `handle`)."""
        return _Client(handle, None)

    @property
    def pid(self) -> int:
        """The engine process id."""
        return self.process.pid

    def call(self, method: str, *args, **kwargs) -> EngineCall:
        """Send one call to the engine process."""
        return self._client.call(method, *args, **kwargs)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine process and remove its socket (idempotent)."""
        atexit.unregister(self.close)
        if self.process.exitcode is None:
            try:
                self._client.call("__shutdown__").result(timeout_s)
            except SyncError:
                pass
            self.process.join(timeout_s)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join(timeout_s)
        self._client.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def _exported(env: dict[str, str]):
    """`env` in os.environ for the duration (to start a child process with it), then restored."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Client:
    """One connection to an engine server; answers are matched to calls by id on a reader thread."""

    local = False

    def __init__(self, handle: dict, process=None):
        from multiprocessing.connection import Client

        self.handle = handle
        self.name = handle["name"]
        self.pid = handle["pid"]
        self._process = process
        self._conn = Client(handle["address"], family="AF_UNIX", authkey=handle["authkey"])
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"sync-client-{self.name}")
        self._reader.start()

    def describe(self) -> str:
        """'engine process NAME (pid N)'."""
        return f"engine process {self.name} (pid {self.pid})"

    def exit_status(self) -> str | None:
        """None while the engine process is alive, else a description of how it ended."""
        if self._process is not None:
            if self._process.exitcode is None:
                self._process.join(0.05)
            code = self._process.exitcode
            return None if code is None else f"exit code {code}"
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "process gone (exit code unknown: not started by this process)"
        return (
            "process is a zombie (exit code unknown: not started by this process)" if state == "Z" else None
        )

    def call(self, method: str, *args, **kwargs) -> EngineCall:
        """Send (id, method, args, kwargs); the answer arrives on the reader thread."""
        rid = next(self._ids)
        f: Future = Future()
        self._pending[rid] = f
        try:
            with self._send_lock:
                self._conn.send((rid, method, args, kwargs))
        except (OSError, EOFError, ValueError) as e:
            self._pending.pop(rid, None)
            f = _done(error=SyncError(f"{self.describe()}: cannot send {method!r} ({e}); {self._status()}"))
        return EngineCall(f, self.describe, method, self.exit_status)

    def _status(self) -> str:
        return self.exit_status() or "process still alive"

    def _read(self) -> None:
        while True:
            try:
                rid, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            f = self._pending.pop(rid, None)
            if f is None:
                continue
            if ok:
                f.set_result(value)
            else:
                f.set_exception(SyncError(f"{self.describe()}: {value}"))
        if self._process is not None:
            self._process.join(2.0)  # reap it so that the error can name the exit code
        err = (
            None if self._closed else SyncError(f"{self.describe()} closed the connection; {self._status()}")
        )
        for rid in list(self._pending):
            f = self._pending.pop(rid)
            f.set_exception(err or SyncError(f"{self.describe()}: connection closed"))

    def close(self) -> None:
        """Close the connection (the engine keeps running)."""
        self._closed = True
        try:
            self._conn.close()
        except OSError:
            pass


class RayEndpoint:
    """An engine in a Ray actor whose `sync_call(method, *args, **kwargs)` forwards to `WeightReceiver.handle`."""

    local = False

    def __init__(self, actor, name: str | None = None):
        self.actor = actor
        self.name = name or f"Ray actor {actor._actor_id.hex()[:12]}"

    def call(self, method: str, *args, **kwargs) -> _RayCall:
        """Submit the call to the actor; `result(timeout)` is `ray.get` with the actor's errors as SyncError."""
        return _RayCall(self.actor.sync_call.remote(method, *args, **kwargs), self.name, method)


class _RayCall:
    """The pending answer of one Ray actor call."""

    def __init__(self, ref, name: str, method: str):
        self.ref, self.name, self.method = ref, name, method

    def result(self, timeout: float | None = None) -> Any:
        """`ray.get(ref, timeout)`; a timeout, a dead actor or an error inside it as SyncError."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(self.ref, timeout=timeout)
        except GetTimeoutError as e:
            raise SyncError(
                f"{self.name} did not answer {self.method!r} within {timeout:.0f} s "
                "(hung or stopped; raise sync.timeout_s if it is only slow)"
            ) from e
        except RayActorError as e:
            raise SyncError(f"{self.name} died during {self.method!r}: {e}") from e
        except RayTaskError as e:
            raise SyncError(f"{self.name}: {self.method!r} failed: {e.cause or e}") from e

    def done(self) -> bool:
        """Whether the answer is there."""
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)
