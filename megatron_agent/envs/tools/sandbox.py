"""The python tool's sandbox: bubblewrap (`bwrap`) command lines and the start-up probe.

A snippet runs as the user `nobody` of a new user namespace, in new PID, mount, network, IPC
and UTS namespaces. Its file system holds only the interpreter, its standard library (with
site-packages hidden), the system's shared libraries, a private /proc and /dev, and one private
size-limited tmpfs that is its working folder; the root is read-only. Nothing of the trainer
(checkout, run folder, checkpoints, home) is mounted. Inside, a small bootstrap sets the
resource limits (address space, CPU time, file size, process count) and then executes the
snippet with `python -I -S -B`.

Every tmpfs the snippet can write has a size: its working folder (`tmp_bytes`) and `/dev/shm`
(`shm_bytes`); the rest of `/dev` is read-only. Those sizes count towards the call's memory
budget (python.py says how the budget is held: one cgroup, or per-process limits).

The process count: RLIMIT_NPROC, set inside the new user namespace, counts only the sandbox's
processes and threads; the kernel does not apply it when the calling user is root (uid 0 outside
maps to uid 0 of the kernel's accounting), so as root the call's pids cgroup (cgroups.py) holds
the count instead.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig

NOBODY = 65534
"""uid and gid of the snippet inside the sandbox."""

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora/RHEL: dnf install "
    "bubblewrap; or run scripts/install.sh as root)"
)

MAX_OPEN_FILES = 64
"""Open files per process (RLIMIT_NOFILE): bounds the kernel buffers (pipes, sockets) a snippet can fill."""

# Runs inside the sandbox: set the limits, then replace itself with the snippet's interpreter.
BOOTSTRAP = (
    "import os, resource as r, sys\n"
    "m, c, f, n = (int(a) for a in sys.argv[1:5])\n"
    "for k, v in ((r.RLIMIT_AS, m), (r.RLIMIT_CPU, c), (r.RLIMIT_FSIZE, f), (r.RLIMIT_NPROC, n),"
    f" (r.RLIMIT_NOFILE, {MAX_OPEN_FILES}), (r.RLIMIT_CORE, 0)):\n"
    "    r.setrlimit(k, (v, v))\n"
    "os.execv(sys.executable, [sys.executable, '-I', '-S', '-B', sys.argv[5]])\n"
)

_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/lib32", "/lib32")


def find_bwrap(path: str | None = None) -> str | None:
    """The bwrap executable (`path` if given and executable, else the one on PATH), or None."""
    if path is not None:
        return path if os.access(path, os.X_OK) else None
    return shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap") if os.access(p, os.X_OK)), None
    )


@functools.cache
def _bwrap_options(bwrap: str) -> frozenset[str]:
    """The options this bwrap build knows (releases before 0.5 lack --size, before 0.8
    --disable-userns)."""
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
    shm_bytes: int,
    seccomp_fd: int | None = None,
) -> list[str]:
    """The bwrap command line running the snippet read from `code_fd` in the private `workdir`:
    `memory_bytes` of address space per process, `tmp_bytes` of working folder, `shm_bytes` of
    /dev/shm. Without --size (bwrap < 0.5) the two tmpfs take the kernel's default size: the
    caller must hold memory with a cgroup then (`supports_tmpfs_size`). `seccomp_fd`: the
    filter of seccomp.py, passed along with `code_fd`."""
    known = _bwrap_options(bwrap)
    argv = [bwrap, "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if "--disable-userns" in known:
        argv += ["--disable-userns"]
    argv += _readonly_mounts()
    sized = "--size" in known
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += (["--size", str(shm_bytes)] if sized else []) + ["--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    argv += (["--size", str(tmp_bytes)] if sized else []) + [
        "--tmpfs",
        workdir,
        "--file",
        str(code_fd),
        f"{workdir}/main.py",
        "--chdir",
        workdir,
    ]
    argv += ["--remount-ro", "/"]
    argv += [interpreter(), "-I", "-S", "-B", "-c", BOOTSTRAP]
    # +1: bwrap's own init (PID 1 of the sandbox) runs as the same user.
    argv += [str(memory_bytes), str(cpu_s), str(file_bytes), str(max_processes + 1), f"{workdir}/main.py"]
    return argv


def supports_tmpfs_size(bwrap: str) -> bool:
    """Whether this bwrap can size a tmpfs (--size, bubblewrap >= 0.5)."""
    return "--size" in _bwrap_options(bwrap)


def probe(bwrap: str) -> str | None:
    """None when a trivial snippet runs in the sandbox here, else bwrap's error output."""
    import tempfile

    from megatron_agent.envs.tools import seccomp

    rules = seccomp.filter_fd() if seccomp.supported() else None
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
            shm_bytes=1 << 20,
            seccomp_fd=rules,
        )
        fds = (code.fileno(),) if rules is None else (code.fileno(), rules)
        try:
            proc = subprocess.run(
                argv, pass_fds=fds, capture_output=True, timeout=30, env=minimal_env("/tmp")
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        finally:
            if rules is not None:
                os.close(rules)
    if proc.returncode == 0 and proc.stdout == b"ok\n":
        return None
    return (proc.stderr or proc.stdout).decode("utf-8", errors="replace").strip()[-1000:] or (
        f"exit status {proc.returncode}"
    )


def minimal_env(home: str) -> dict[str, str]:
    """The whole environment a snippet gets."""
    return {"PATH": "/usr/bin:/bin", "HOME": home, "PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8"}
