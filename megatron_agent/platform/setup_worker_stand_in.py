"""What the raylet of a lean local cluster starts each worker with, in place of Ray's setup_worker.py.

The raylet starts every worker as `python setup_worker.py [flags] default_worker.py ...`, with the
worker's runtime environment, as the runtime-env agent prepared it, in
`--serialized-runtime-env-context` (JSON: environment variables, the Python to run, a command
prefix, ...). Ray's script imports its runtime-env package and logging to read that JSON, sets the
variables and execs the worker: about 0.5 s of CPU before each worker's own start, on the start
path of every Megatron rank and rollout engine, and on a small machine on the cores their starts
share. A run's workers only ever carry environment variables, so this stand-in does that case
with the standard library: the variables set as Ray sets them (`${NAME}` expanded, an unset one
empty), then the worker exec'd in this same process. Any other context (a command prefix, a
container's entry point, Java jars, a language other than Python, a key it does not know) goes to
Ray's own setup_worker.py with the same arguments, so nothing a runtime environment can do is
lost.

    python setup_worker_stand_in.py --serialized-runtime-env-context=JSON --language=PYTHON WORKER...

Standard library only, and nothing of this package: it runs before the worker has any of it.
"""

import argparse
import importlib.util
import json
import os
import re
import sys

KNOWN_CONTEXT_FIELDS = {
    "command_prefix",
    "env_vars",
    "py_executable",
    "override_worker_entrypoint",
    "java_jars",
}
"""The fields of Ray's `RuntimeEnvContext` that this stand-in knows (a context with another one
goes to Ray's script); it acts alone when only the variables and the Python executable are set."""

UNSET_VARIABLE = re.compile(r"\$\{[A-Z0-9_]+\}")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the two arguments the raylet adds, everything else for the worker), as Ray's script
    reads them."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    return parser.parse_known_args(argv)


def is_simple(context: dict, language: str | None) -> bool:
    """Whether the context only sets variables (and names a Python) for a Python worker."""
    return (
        language == "PYTHON"
        and set(context) <= KNOWN_CONTEXT_FIELDS
        and not context.get("command_prefix")
        and not context.get("override_worker_entrypoint")
        and not context.get("java_jars")
    )


def expanded(value: str) -> str:
    """`value` with `$NAME` / `${NAME}` replaced from the environment, an unset `${NAME}` by
    nothing (what Ray's `update_envs` does)."""
    return UNSET_VARIABLE.sub("", os.path.expandvars(value))


def ray_setup_worker() -> str:
    """The path of Ray's own setup_worker.py, found without importing Ray."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("setup_worker_stand_in: Ray is not importable in this Python")
    return os.path.join(list(spec.submodule_search_locations)[0], "_private", "workers", "setup_worker.py")


def main(argv: list[str]) -> None:
    """Exec the worker with its variables set, or hand everything to Ray's script."""
    args, worker = parse(argv)
    try:
        context = json.loads(args.serialized_runtime_env_context or "{}")
    except json.JSONDecodeError:
        context = None
    if not isinstance(context, dict) or not is_simple(context, args.language):
        os.execv(sys.executable, [sys.executable, ray_setup_worker(), *argv])
    for name, value in (context.get("env_vars") or {}).items():
        os.environ[name] = expanded(value)
    python = context.get("py_executable") or sys.executable
    os.execvp(python, [python, *worker])


if __name__ == "__main__":
    main(sys.argv[1:])
