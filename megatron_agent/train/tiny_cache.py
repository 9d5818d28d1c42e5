"""The run's tiny base model (`model.tiny_family`), made once per machine and code version.

A run without `model.path` starts from a tiny random model (`models/tiny.py`) in
`<run_dir>/base_model`. Making it imports transformers' model classes, and through them
torch._dynamo, inductor and triton: 2-3 s, and about 150 MB that the driver would hold for the
whole run. `make_tiny_base_model` makes it once, keeps the folder in the per-user cache under a
digest of everything it is a function of (the family, the seed, the versions of torch,
transformers and tokenizers, and the source of this package), and copies the cached folder into
the run folder next time: the same bytes, without the imports.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from megatron_agent.platform.user_cache import cache_dir
from megatron_agent.weights.folders import publish, staging_dir

PACKAGE = Path(__file__).resolve().parents[1]  # megatron_agent/
_KEEP = 8  # cached models kept (the most recently used)


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
    made there first when absent (in this process, which then holds transformers' model classes
    for this run only); made straight into `out` when the cache cannot be written."""
    out = Path(out)
    cached = cache_dir() / "tiny_models" / tiny_model_key(family, seed)
    try:
        if not (cached / "config.json").is_file():
            _make_cached(family, seed, cached)
        os.utime(cached)  # most recently used
    except OSError:  # the cache cannot be written
        _make(family, seed, out)
        return out
    shutil.copytree(cached, out, dirs_exist_ok=True)
    _forget_old(cached.parent)
    return out


def _make_cached(family: str, seed: int, cached: Path) -> None:
    """Make the model in a staging folder beside `cached` and publish it there (weights.folders):
    whole or not at all."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(cached)
    try:
        _make(family, seed, staging)
        try:
            publish(staging, cached)
        except OSError:
            if not (cached / "config.json").is_file():  # not another run's copy: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make(family: str, seed: int, out: Path) -> None:
    from megatron_agent.models.tiny import make_quickstart_model, make_tiny_model

    if family == "quickstart":
        make_quickstart_model(out, seed=seed)
    else:
        make_tiny_model(out, family, seed=seed)


def _forget_old(folder: Path) -> None:
    """Remove all but the `_KEEP` most recently used cached models, and what a make that was
    killed left (its hidden staging folder, once older than an hour)."""
    import time

    entries = [(p, p.stat().st_mtime) for p in folder.iterdir()]
    models = sorted((e for e in entries if not e[0].name.startswith(".")), key=lambda e: e[1])
    stale = [p for p, mtime in entries if p.name.startswith(".") and mtime < time.time() - 3600]
    for old in [p for p, _ in models[:-_KEEP]] + stale:
        shutil.rmtree(old, ignore_errors=True)
