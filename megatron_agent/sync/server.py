"""The engine process behind `SubprocessEndpoint`: a VLLMEngine + WeightReceiver on a local socket.

Kept free of heavy imports at module level. The process starts with its environment (threads,
vLLM settings, glibc tunables) already set by `SubprocessEndpoint`. Calls from all connections are
served one at a time (the engine is not thread-safe). The process exits when asked to, or when
the process that started it is gone.
"""

from __future__ import annotations

import os
import threading


def serve_engine(
    address: str,
    authkey: bytes,
    engine_class: str,
    model_path: str,
    engine_kwargs: dict,
    parent_pid: int,
) -> None:
    """Process main: build the engine, then answer (id, method, args, kwargs) calls until shut down.

    `engine_class` is 'module:Class' (VLLMEngine by default), built as Class(model_path, **engine_kwargs).
    """
    import importlib
    from multiprocessing.connection import Listener

    from megatron_agent.platform import startup_gc

    startup_gc.imports_begin()  # until vLLM is imported (`VLLMEngine`): rare collections
    from megatron_agent.sync.receiver import WeightReceiver

    module, _, cls = engine_class.partition(":")
    engine = getattr(importlib.import_module(module), cls)(model_path, **engine_kwargs)
    startup_gc.imports_end(freeze=False)  # ended by VLLMEngine already; any other engine: here
    receiver = WeightReceiver(engine)
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    lock = threading.Lock()
    stop = threading.Event()

    def serve(conn) -> None:
        while not stop.is_set():
            try:
                rid, method, args, kwargs = conn.recv()
            except (EOFError, OSError):
                return
            if method == "__shutdown__":
                stop.set()
                conn.send((rid, True, None))
                return
            try:
                with lock:
                    reply = (rid, True, receiver.handle(method, *args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - every error goes back to the caller
                reply = (rid, False, f"{type(e).__name__}: {e}")
            try:
                conn.send(reply)
            except (OSError, EOFError):
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    with open(address + ".ready", "w") as f:
        f.write(str(os.getpid()))
    while not stop.wait(1.0):
        if os.getppid() != parent_pid:
            break  # the owner is gone: nobody can shut us down
    listener.close()
    os._exit(0)  # skip vLLM's interpreter-exit teardown (slow, and nothing is left to flush)
