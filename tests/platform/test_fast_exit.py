"""`platform.fast_exit.exit_process`: everything Python's exit does that a program can depend on,
then the process ends without the interpreter's teardown (and exits the usual way under a profiler)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO

# An object whose __del__ only the interpreter's teardown calls: it writes "done" to
# <argv[1]>/teardown (created empty at once).
TEARDOWN = textwrap.dedent(
    """
    import os, pathlib, sys

    out = pathlib.Path(sys.argv[1])

    class Teardown:
        def __del__(self, write=os.write, fd=os.open(out / "teardown", os.O_WRONLY | os.O_CREAT)):
            write(fd, b"done")

    KEPT = Teardown()
    """
)
# A process that leaves work for its exit: a non-daemon thread still writing, a thread pool with a
# queued task, an atexit function, unflushed stdout, and the object above.
CHILD = TEARDOWN + textwrap.dedent(
    """
    import atexit, concurrent.futures, threading, time
    from megatron_agent.platform.fast_exit import exit_process

    if sys.argv[2] == "profiled":
        sys.setprofile(lambda *args: None)

    def late_write():
        time.sleep(0.5)
        (out / "thread").write_text("done")

    threading.Thread(target=late_write).start()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(time.sleep, 0.3)
    pool.submit((out / "pool").write_text, "done")
    atexit.register(lambda: (out / "atexit").write_text("done"))
    sys.stdout.write("buffered, no newline")
    exit_process(3)
    """
)


def _run(tmp_path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), mode],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_exit_process_finishes_the_exit_work_and_skips_the_teardown(tmp_path):
    proc = _run(tmp_path, "plain")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered, no newline", proc.stdout
    for name in ("thread", "pool", "atexit"):
        assert (tmp_path / name).read_text() == "done", name
    assert (tmp_path / "teardown").read_text() == "", "the interpreter was torn down"


def test_under_a_profiler_the_process_exits_the_usual_way(tmp_path):
    proc = _run(tmp_path, "profiled")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered, no newline", proc.stdout
    for name in ("thread", "pool", "atexit", "teardown"):
        assert (tmp_path / name).read_text() == "done", name


def test_the_command_line_exits_through_it(tmp_path):
    source = (REPO / "megatron_agent" / "__main__.py").read_text()
    assert "exit_process(main())" in source
    # `python -m megatron_agent` as runpy runs it, in a process holding the teardown-only object:
    # its status comes back and the interpreter is not torn down.
    as_main = TEARDOWN + textwrap.dedent(
        """
        import runpy
        sys.argv = ["megatron_agent", "no-such-command"]
        runpy.run_module("megatron_agent", run_name="__main__", alter_sys=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", as_main, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown command 'no-such-command'" in proc.stderr
    assert (tmp_path / "teardown").read_text() == "", "the interpreter was torn down"
