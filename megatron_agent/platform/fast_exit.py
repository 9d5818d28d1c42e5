"""End a command's process as Python's exit would, without tearing the interpreter down.

A command's process has imported torch, transformers, Ray and (for some) megatron-core: millions
of objects. When `main` returns, Python's own exit first does what a program can depend on (it
joins the non-daemon threads, after shutting down `concurrent.futures` pools; runs the `atexit`
functions: Ray's, logging's, multiprocessing's, temporary folders'; flushes stdout and stderr),
then clears every module and collects what is left, object by object: 1.5 s after the quickstart
run's last line on a 2-core machine, with nothing left to write. `exit_process` does the first
part and ends the process there (`os._exit`).

What it skips is the interpreter's teardown only: the `__del__` of objects still alive at exit.
This project's writers (the run log, TensorBoard, checkpoints, HF folders, the score output)
close their files themselves. Under a profiler or a tracer (cProfile, a debugger, coverage
measured by tracing) the process exits the usual way, so that the tool can write its results
after `main` returns.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Exit with status `code`: non-daemon threads joined, `atexit` functions run, stdout and
    stderr flushed, then `os._exit` (the usual `sys.exit` under a profiler or tracer, or where
    this Python lacks the hooks used)."""
    shutdown_threads = getattr(threading, "_shutdown", None)
    run_exit_functions = getattr(atexit, "_run_exitfuncs", None)
    if sys.getprofile() or sys.gettrace() or shutdown_threads is None or run_exit_functions is None:
        sys.exit(code)
    shutdown_threads()  # what Python's exit calls first: thread pools shut down, threads joined
    run_exit_functions()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by a caller
            pass
    os._exit(code)
