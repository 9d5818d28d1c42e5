"""The run's tiny base model (`model.tiny_family`), made once per machine and code version.

A run without `model.path` starts from a tiny random model (`models/tiny.py`) in
`<run_dir>/base_model`. Making it imports transformers' model classes, and through them
torch._dynamo, inductor and triton: 2-3 s, and about 150 MB that the driver would hold for the
whole run. `make_tiny_base_model` makes it in a child process instead, keeps the folder in the
per-user cache under a digest of everything it is a function of (the family, the seed, the
versions of torch, transformers and tokenizers, and the source of this package), and copies the
cached folder into the run folder next time: the same bytes, without the imports.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_agent.platform.user_cache import cache_dir

PACKAGE = Path(__file__).resolve().parents[1]  # megatron_agent/
_KEEP = 8  # cached models kept (the most recently used)
_MAKE = """
import sys
from megatron_agent.models.tiny import make_quickstart_model, make_tiny_model
family, out, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
if family == "quickstart":
    make_quickstart_model(out, seed=seed)
else:
    make_tiny_model(out, family, seed=seed)
"""


def tiny_model_key(family: str, seed: int) -> str:
    """The digest of what the tiny model's files are a function of."""
    from importlib.metadata import version

    digest = hashlib.sha256(f"{family}\0{seed}\0".encode())
    for dist in ("torch", "transformers", "tokenizers"):
        digest.update(f"{dist}={version(dist)}\0".encode())
    for source in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(source.relative_to(PACKAGE)).encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def make_tiny_base_model(family: str, seed: int, out: str | os.PathLike) -> Path:
    """Write the tiny `family` model made with `seed` to `out`: copied from the per-user cache,
    made there first (in a child process) when absent; made straight into `out` when the cache
    cannot be written."""
    out = Path(out)
    cached = cache_dir() / "tiny_models" / tiny_model_key(family, seed)
    try:
        if not (cached / "config.json").is_file():
            cached.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".making."))
            try:
                _make_in_child(family, seed, staging)
                os.replace(staging, cached)  # whole or not at all; another run may have won
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        os.utime(cached)  # most recently used
    except OSError:
        _make_in_child(family, seed, out)
        return out
    shutil.copytree(cached, out, dirs_exist_ok=True)
    _forget_old(cached.parent)
    return out


def _make_in_child(family: str, seed: int, out: Path) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _MAKE, family, str(out), str(seed)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"making the tiny {family!r} model failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )


def _forget_old(folder: Path) -> None:
    """Remove all but the `_KEEP` most recently used cached models."""
    models = sorted(
        (p for p in folder.iterdir() if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime
    )
    for old in models[:-_KEEP]:
        shutil.rmtree(old, ignore_errors=True)
