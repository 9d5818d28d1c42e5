"""`platform.accelerator.cuda_available` gives torch's answer, without importing torch where the
installed torch is a CPU-only build (its `torch/version.py` names no CUDA and no ROCm)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import textwrap

import pytest

from megatron_agent.platform import accelerator
from tests.conftest import fresh_python

CPU_BUILD = """
from typing import Optional
__version__ = '2.13.0+cpu'
cuda: Optional[str] = None
hip: Optional[str] = None
"""


def fake_torch(monkeypatch, tmp_path, version_py: str | None) -> None:
    """`find_spec("torch")` finds a package at tmp_path/torch with `version_py` (None: no file)."""
    package = tmp_path / "torch"
    package.mkdir()
    if version_py is not None:
        (package / "version.py").write_text(textwrap.dedent(version_py))
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: spec if name == "torch" else real(name, *a)
    )


@pytest.mark.parametrize(
    "version_py, has_gpu",
    [
        (CPU_BUILD, False),
        ("cuda = None\nhip = None\n", False),
        (CPU_BUILD.replace("cuda: Optional[str] = None", "cuda: Optional[str] = '12.8'"), True),
        (CPU_BUILD.replace("hip: Optional[str] = None", "hip: Optional[str] = '6.4.1'"), True),
        ("cuda = None\n", True),  # says nothing of ROCm: torch is asked
        ("cuda = None\nhip = None\ndef (:\n", True),  # unreadable: torch is asked
        (None, True),  # no version file: torch is asked
    ],
)
def test_the_build_is_read_from_torchs_version_file(monkeypatch, tmp_path, version_py, has_gpu):
    fake_torch(monkeypatch, tmp_path, version_py)
    assert accelerator.torch_has_gpu_backend() is has_gpu


def test_no_torch_installed_asks_torch(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    assert accelerator.torch_has_gpu_backend() is True


def test_the_answer_is_torchs_and_a_cpu_build_is_not_imported():
    code = textwrap.dedent(
        """
        import json, sys
        from megatron_agent.platform.accelerator import cuda_available, torch_has_gpu_backend
        answer, gpu_build = cuda_available(), torch_has_gpu_backend()
        imported = "torch" in sys.modules
        import torch
        print(json.dumps({"answer": answer, "torch": torch.cuda.is_available(), "imported": imported,
                          "gpu_build": gpu_build, "built_for": [torch.version.cuda, torch.version.hip]}))
        """
    )
    out = fresh_python(code)
    assert out["answer"] == out["torch"]
    assert out["gpu_build"] == (out["built_for"] != [None, None])
    assert out["imported"] == out["gpu_build"]  # torch is imported only where its build could have a GPU
