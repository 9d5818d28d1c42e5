"""Whether this process can use a CUDA (or ROCm) GPU, asked without importing torch where the
answer is already known.

torch takes about 1 s of CPU to import, and the driver of a run needs it for nothing before its
workers start: only to learn whether there is a GPU. A torch built for CPU only (`torch.version`
names no CUDA and no ROCm: the CPU stack's `+cpu` wheel) answers `torch.cuda.is_available()` with
False on any machine, so that build is recognised from its `torch/version.py` alone; any other
build, or a version file that cannot be read, asks torch itself.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path


def cuda_available() -> bool:
    """`torch.cuda.is_available()`; without importing torch when the installed torch has no GPU
    backend (False) and torch is not imported yet."""
    if "torch" not in sys.modules and not torch_has_gpu_backend():
        return False
    import torch

    return bool(torch.cuda.is_available())


def torch_has_gpu_backend() -> bool:
    """False when the installed torch's `torch/version.py` sets both `cuda` and `hip` to None (a
    CPU-only build); True otherwise, also when torch or its version file cannot be found or read
    (the caller then asks torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(version_file.read_text())
    except (OSError, SyntaxError, ValueError):
        return True
    backends = {"cuda": True, "hip": True}  # unknown until the file says None
    for node in tree.body:
        target, value = _assignment(node)
        if target in backends:
            backends[target] = not (isinstance(value, ast.Constant) and value.value is None)
    return any(backends.values())


def _assignment(node: ast.stmt) -> tuple[str | None, ast.expr | None]:
    """(name, value) of `name = value` or `name: T = value` at a module's top level."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id, node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id, node.value
    return None, None
