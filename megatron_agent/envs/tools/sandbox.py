"""The python tool's sandbox: bubblewrap (`bwrap`) command lines and a per-call pids cgroup.

A snippet runs as the user `nobody` of a new user namespace, in new PID, mount, network, IPC
and UTS namespaces. Its file system holds only the interpreter, its standard library (with
site-packages hidden), the system's shared libraries, a private /proc and /dev, and one private
size-limited tmpfs that is its working folder; the root is read-only. Nothing of the trainer
(checkout, run folder, checkpoints, home) is mounted. Inside, a small bootstrap sets the
resource limits (address space, CPU time, file size, process count) and then executes the
snippet with `python -I -S -B`.

The process count: RLIMIT_NPROC, set inside the new user namespace, counts only the sandbox's
processes and threads; the kernel does not apply it when the calling user is root (uid 0 outside
maps to uid 0 of the kernel's accounting), so as root each call also gets its own pids cgroup
(v1 or v2) when one can be created; `process_limit_mechanism()` says which applies.
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

NOBODY = 65534
"""uid and gid of the snippet inside the sandbox."""

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora/RHEL: dnf install "
    "bubblewrap; or run scripts/install.sh as root), or set tools.python.sandbox=auto to run "
    "with resource limits only"
)

# Runs inside the sandbox: set the limits, then replace itself with the snippet's interpreter.
BOOTSTRAP = (
    "import os, resource as r, sys\n"
    "m, c, f, n = (int(a) for a in sys.argv[1:5])\n"
    "for k, v in ((r.RLIMIT_AS, m), (r.RLIMIT_CPU, c), (r.RLIMIT_FSIZE, f), (r.RLIMIT_NPROC, n),"
    " (r.RLIMIT_CORE, 0)):\n"
    "    r.setrlimit(k, (v, v))\n"
    "os.execv(sys.executable, [sys.executable, '-I', '-S', '-B', sys.argv[5]])\n"
)

_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/lib32", "/lib32")
_counter = itertools.count()


def find_bwrap(path: str | None = None) -> str | None:
    """The bwrap executable (`path` if given and executable, else the one on PATH), or None."""
    if path is not None:
        return path if os.access(path, os.X_OK) else None
    return shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap") if os.access(p, os.X_OK)), None
    )


@functools.cache
def _bwrap_options(bwrap: str) -> frozenset[str]:
    """The options this bwrap build knows (older releases lack --size or --disable-userns)."""
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(word for word in text.split() if word.startswith("--"))


def interpreter() -> str:
    """The real interpreter binary (a virtual environment's base interpreter)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _readonly_mounts() -> list[str]:
    """bwrap arguments mounting the interpreter, its standard library and the shared libraries."""
    args: list[str] = []
    for lib in _SYSTEM_LIBS:
        if os.path.islink(lib):
            args += ["--symlink", os.readlink(lib), lib]
        elif os.path.isdir(lib):
            args += ["--ro-bind", lib, lib]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    exe = interpreter()
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    dynload = os.path.realpath(sysconfig.get_config_var("DESTSHARED") or os.path.join(stdlib, "lib-dynload"))
    paths = [exe, stdlib, dynload]
    soname, libdir = sysconfig.get_config_var("INSTSONAME"), sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and soname and libdir:
        paths.append(os.path.join(libdir, soname))
    for path in paths:
        if os.path.exists(path) and not any(path.startswith(lib + "/") for lib in _SYSTEM_LIBS):
            args += ["--ro-bind", path, path]
    # Installed packages stay out of sight: standard library only.
    for hidden in {os.path.join(stdlib, "site-packages"), os.path.join(stdlib, "dist-packages")}:
        if os.path.isdir(hidden):
            args += ["--tmpfs", hidden, "--remount-ro", hidden]
    for lib in ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages"):
        if os.path.isdir(lib) and os.path.realpath(lib).startswith(tuple(_SYSTEM_LIBS)):
            args += ["--tmpfs", lib, "--remount-ro", lib]
    return args


def bwrap_argv(
    bwrap: str,
    *,
    workdir: str,
    code_fd: int,
    memory_bytes: int,
    cpu_s: int,
    file_bytes: int,
    max_processes: int,
    tmp_bytes: int,
) -> list[str]:
    """The bwrap command line running the snippet read from `code_fd` in the private `workdir`."""
    known = _bwrap_options(bwrap)
    argv = [bwrap, "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if "--disable-userns" in known:
        argv += ["--disable-userns"]
    argv += _readonly_mounts()
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if "--size" in known:
        argv += ["--size", str(tmp_bytes)]
    argv += ["--tmpfs", workdir, "--file", str(code_fd), f"{workdir}/main.py", "--chdir", workdir]
    argv += ["--remount-ro", "/"]
    argv += [interpreter(), "-I", "-S", "-B", "-c", BOOTSTRAP]
    # +1: bwrap's own init (PID 1 of the sandbox) runs as the same user.
    argv += [str(memory_bytes), str(cpu_s), str(file_bytes), str(max_processes + 1), f"{workdir}/main.py"]
    return argv


def probe(bwrap: str) -> str | None:
    """None when a trivial snippet runs in the sandbox here, else bwrap's error output."""
    import tempfile

    with tempfile.TemporaryFile() as code:
        code.write(b"print('ok')")
        code.flush()
        code.seek(0)
        argv = bwrap_argv(
            bwrap,
            workdir="/tmp/ma_python_probe",
            code_fd=code.fileno(),
            memory_bytes=512 << 20,
            cpu_s=10,
            file_bytes=1 << 20,
            max_processes=8,
            tmp_bytes=1 << 20,
        )
        try:
            proc = subprocess.run(
                argv, pass_fds=(code.fileno(),), capture_output=True, timeout=30, env=minimal_env("/tmp")
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
    if proc.returncode == 0 and proc.stdout == b"ok\n":
        return None
    return (proc.stderr or proc.stdout).decode("utf-8", errors="replace").strip()[-1000:] or (
        f"exit status {proc.returncode}"
    )


def minimal_env(home: str) -> dict[str, str]:
    """The whole environment a snippet gets."""
    return {"PATH": "/usr/bin:/bin", "HOME": home, "PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8"}


@functools.cache
def _pids_cgroup_parent() -> Path | None:
    """A cgroup folder in which this (root) process may create pids-limited children, or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "pids" in controllers.split(","):
            candidates.append(Path("/sys/fs/cgroup/pids") / rel.lstrip("/"))
        elif controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").is_file():
            base = Path("/sys/fs/cgroup") / rel.lstrip("/")
            try:
                if "pids" in (base / "cgroup.subtree_control").read_text().split():
                    candidates.append(base)
            except OSError:
                pass
    for base in candidates:
        test = base / f"ma_python_probe_{os.getpid()}"
        try:
            test.mkdir()
            (test / "pids.max").write_text("8")
            test.rmdir()
            return base
        except OSError:
            try:
                test.rmdir()
            except OSError:
                pass
    return None


def process_limit_mechanism() -> str | None:
    """How max_processes is enforced here: 'rlimit' (non-root), 'cgroup' (root), or None."""
    if os.geteuid() != 0:
        return "rlimit"
    return "cgroup" if _pids_cgroup_parent() is not None else None


class PidsCgroup:
    """A pids cgroup for one call (root only): processes started by `enter` (in the child before
    exec) are limited to `max_pids`; `close` kills what is left and removes the cgroup."""

    def __init__(self, max_pids: int):
        """Create the cgroup; raises OSError when that is not possible."""
        parent = _pids_cgroup_parent()
        if parent is None:
            raise OSError("no writable pids cgroup")
        self.path = parent / f"ma_python_{os.getpid()}_{next(_counter)}"
        self.path.mkdir()
        (self.path / "pids.max").write_text(str(max_pids))

    def enter(self) -> None:
        """Move the calling process into the cgroup (used as a preexec function)."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def close(self) -> None:
        """Kill every process still in the cgroup, then remove it."""
        import signal
        import time

        for _ in range(100):
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        try:
            self.path.rmdir()
        except OSError:
            pass
