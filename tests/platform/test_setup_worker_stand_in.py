"""The stand-in for Ray's setup_worker.py (`platform/setup_worker_stand_in.py`): a worker whose
runtime environment only sets variables is exec'd in the same process with them set as Ray sets
them; any other runtime environment goes to Ray's own script. (tests/train/test_lean_cluster.py
runs a real cluster's actors through it.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_agent.platform import setup_worker_stand_in
from megatron_agent.train.cluster import SETUP_WORKER_STAND_IN

# The "worker": reports its pid, its arguments and the variables it was asked about.
WORKER = "import json, os, sys; print(json.dumps([os.getpid(), sys.argv[1:], {n: os.environ.get(n) for n in sys.argv[1:]}]))"


def start(context: dict | None, *worker_args: str, language: str = "PYTHON") -> tuple[int, list, dict]:
    """Run the stand-in as the raylet does; (the worker's pid, its arguments, its variables)."""
    argv = [sys.executable, str(SETUP_WORKER_STAND_IN)]
    if context is not None:
        argv.append(f"--serialized-runtime-env-context={json.dumps(context)}")
    argv += [f"--language={language}", "-c", WORKER, *worker_args]
    env = dict(os.environ, OUTER="outer")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    pid, args, variables = json.loads(out.strip().splitlines()[-1])
    assert pid == proc.pid  # exec'd: the process the raylet started is the worker
    return pid, args, variables


def test_the_worker_gets_its_variables_and_its_arguments_unchanged():
    context = {
        "env_vars": {"PLAIN": "a b", "FROM_OUTER": "x${OUTER}y", "DROPPED": "p${NOT_SET_ANYWHERE}q"},
        "command_prefix": [],
        "py_executable": sys.executable,
        "override_worker_entrypoint": None,
        "java_jars": [],
    }
    _, args, variables = start(context, "PLAIN", "FROM_OUTER", "DROPPED", "OUTER")
    assert args == ["PLAIN", "FROM_OUTER", "DROPPED", "OUTER"]
    assert variables == {"PLAIN": "a b", "FROM_OUTER": "xoutery", "DROPPED": "pq", "OUTER": "outer"}


def test_no_context_is_an_empty_environment():
    _, args, variables = start(None, "OUTER", "--flag=value with space")
    assert args == ["OUTER", "--flag=value with space"] and variables["OUTER"] == "outer"


def test_a_command_prefix_goes_to_rays_own_script():
    context = {"env_vars": {"SET": "1"}, "command_prefix": ["export", "VIA_RAY_SCRIPT=yes", "&&"]}
    _, _, variables = start(context, "SET", "VIA_RAY_SCRIPT")
    assert variables == {"SET": "1", "VIA_RAY_SCRIPT": "yes"}


@pytest.mark.parametrize(
    "context, language",
    [
        ({"env_vars": {"A": "1"}}, "JAVA"),
        ({"env_vars": {"A": "1"}, "java_jars": ["/x.jar"]}, "PYTHON"),
        ({"override_worker_entrypoint": "/other/default_worker.py"}, "PYTHON"),
        ({"a_field_of_a_later_ray": 1}, "PYTHON"),
    ],
)
def test_anything_but_variables_for_python_is_not_the_stand_ins(context, language):
    assert not setup_worker_stand_in.is_simple(context, language)
    assert setup_worker_stand_in.is_simple({"env_vars": {"A": "1"}, "py_executable": "python"}, "PYTHON")


def test_variables_expand_as_rays_update_envs(monkeypatch):
    from ray._private.utils import update_envs

    monkeypatch.setenv("OUTER", "o")
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    values = {
        "A": "$OUTER/${OUTER}",
        "B": "${NOT_SET_ANYWHERE}x",
        "C": "$NOT_SET_ANYWHERE",
        "D": "${lower_case}",
    }
    ours = {name: setup_worker_stand_in.expanded(value) for name, value in values.items()}
    for name in values:
        monkeypatch.delenv(name, raising=False)
    update_envs(values)
    assert ours == {name: os.environ[name] for name in values}


def test_rays_script_is_found_without_importing_ray():
    code = (
        "import sys; from megatron_agent.platform import setup_worker_stand_in as s; "
        "print(s.ray_setup_worker(), 'ray' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0].endswith("ray/_private/workers/setup_worker.py") and os.path.exists(out[0])
    assert out[1] == "False"
