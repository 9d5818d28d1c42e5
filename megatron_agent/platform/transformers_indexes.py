"""transformers' two import-time indexes, kept in the per-user cache.

`import transformers` builds two indexes in every process, and neither changes between processes
on one machine:

- which installed distribution provides each importable package
  (`importlib.metadata.packages_distributions()`, at the import of
  `transformers.utils.import_utils`): it reads the file list of every installed distribution
  (about 26,500 entries for this stack's 106: 0.25-0.34 s);
- the lazy module's import structure (`define_import_structure` on `transformers/models`): it
  reads all 1,565 files of that folder for their `__all__` and backends (0.24-0.27 s), and a
  second time, under another argument, when `transformers.models` is imported (every vLLM
  engine does).

`install()` (called by `megatron_agent/__init__.py`, so before any of our processes imports
transformers) adds an import hook for `transformers.utils.import_utils` that answers both from
JSON files in the per-user cache (`platform/user_cache.py`) when their keys match, and computes
and records them otherwise. A key is everything the answer is a function of, as seen from the file
system:

- distributions: the Python version, `sys.path` (absolute) and the modification time of each of its
  folders (installing, upgrading or removing a distribution adds or removes a `*.dist-info`
  folder in one of them);
- the import structure: the Python version, the argument, transformers' `import_utils.py` (its
  time and size: the parser), and the time of `models` and of each of its entries (an install,
  and an editor's save by rename, change them).

A file that cannot be read or does not hold what it should, a key that cannot be made, a
transformers without these functions: the index is computed as transformers does (it is only
ever a cache). `MEGATRON_AGENT_TRANSFORMERS_INDEXES=0` turns the hook off.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import os
import sys
from pathlib import Path

from megatron_agent.platform.user_cache import cache_dir, read_json, write_json

OFF_ENV = "MEGATRON_AGENT_TRANSFORMERS_INDEXES"
TARGET = "transformers.utils.import_utils"
_FOLDER = "transformers_indexes"
_MAX_FILES = 64  # the oldest entries are removed beyond this
hits: list[str] = []  # the indexes this process read from the cache ("distributions", "structure")


def install() -> bool:
    """Add the import hook for transformers' indexes; False (nothing done) when it is off, when
    transformers' module is imported already, or when the hook is in place."""
    if os.environ.get(OFF_ENV) == "0" or TARGET in sys.modules:
        return False
    if any(isinstance(finder, _IndexesFinder) for finder in sys.meta_path):
        return False
    sys.meta_path.insert(0, _IndexesFinder())
    return True


class _IndexesFinder:
    """A meta path finder: finds `transformers.utils.import_utils` as the path finder does, and
    has its loader run the module with both indexes answered from the cache. (Every process
    that imports this package makes one: its module imports only what Python's start has.)"""

    def find_spec(self, fullname, path, target=None):
        """The module's usual spec, with the caching execution; None for every other module."""
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # once: a reload or a second import goes the usual way
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            with _cached_packages_distributions():
                run_module(module)
            _cache_import_structure(module)

        spec.loader.exec_module = exec_module  # this spec's own loader instance
        return spec


# ----------------------------------------------------------------------------- the two indexes
@contextlib.contextmanager
def _cached_packages_distributions():
    """`importlib.metadata.packages_distributions` answered from the cache within the block."""
    import importlib.metadata as metadata

    original = metadata.packages_distributions

    def packages_distributions():
        key = _distributions_key()
        cached = _read(key) if key else None
        if _is_mapping(cached):
            hits.append("distributions")
            return cached
        mapping = original()
        if key:
            _write(key, mapping)
        return mapping

    metadata.packages_distributions = packages_distributions
    try:
        yield
    finally:
        metadata.packages_distributions = original


def _cache_import_structure(module) -> None:
    """Replace the module's `define_import_structure` by one that answers the calls on the
    `models` folder from the cache (other folders are small: they go to the original)."""
    original = getattr(module, "define_import_structure", None)
    module_file = getattr(module, "__file__", None)
    if not callable(original) or not module_file:
        return
    models = Path(module_file).resolve().parents[1] / "models"

    @functools.lru_cache
    def define_import_structure(module_path, prefix=None):
        key = _structure_key(module_path, prefix, models, module_file)
        cached = _read(key) if key else None
        structure = _decode_structure(cached)
        if structure is not None:
            hits.append("structure")
            return structure
        structure = original(module_path, prefix)
        if key:
            _write(key, _encode_structure(structure))
        return structure

    define_import_structure.__doc__ = original.__doc__
    define_import_structure.__wrapped__ = original
    module.define_import_structure = define_import_structure


# ----------------------------------------------------------------------------- keys
def _mtime(path: str | os.PathLike) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _digest(parts: list) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _distributions_key() -> str | None:
    """What `packages_distributions()` reads, as a digest: the folders of `sys.path` ('' and a
    relative entry are the current folder's, so taken absolute) and their times."""
    folders = [os.path.abspath(p or ".") for p in sys.path if isinstance(p, str)]
    return _digest(["distributions", list(sys.version_info[:2]), [(f, _mtime(f)) for f in folders]])


def _structure_key(module_path, prefix, models: Path, module_file: str) -> str | None:
    """The digest of what the import structure of `module_path` reads, when that is the `models`
    folder (the folder itself, or a file in it); None otherwise."""
    try:
        given = Path(module_path).resolve()
        folder = given if given.is_dir() else given.parent
        if folder != models:
            return None
        with os.scandir(models) as entries:
            times = sorted((e.name, e.stat(follow_symlinks=False).st_mtime_ns) for e in entries)
        parser = os.stat(module_file)
    except (OSError, TypeError, ValueError):
        return None
    return _digest(
        [
            "structure",
            list(sys.version_info[:2]),
            str(module_path),
            given.is_dir(),
            prefix,
            [parser.st_mtime_ns, parser.st_size],
            _mtime(models),
            times,
        ]
    )


# ----------------------------------------------------------------------------- the files
def _read(key: str):
    """The JSON value stored under `key`; None when absent or unreadable."""
    return read_json(cache_dir() / _FOLDER / f"{key}.json")


def _write(key: str, value) -> None:
    """Store `value` under `key` (`user_cache.write_json`), the oldest files beyond `_MAX_FILES`
    removed; nothing when the folder cannot be written (it only saves time)."""
    folder = cache_dir() / _FOLDER
    if not write_json(folder / f"{key}.json", value):
        return
    with contextlib.suppress(OSError):
        files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
        for old in files[:-_MAX_FILES]:
            old.unlink(missing_ok=True)


def _is_mapping(value) -> bool:
    """A packages -> distributions mapping as `packages_distributions()` returns it."""
    return isinstance(value, dict) and all(isinstance(k, str) and _is_names(v) for k, v in value.items())


def _encode_structure(structure: dict) -> list:
    """{frozenset(backends): {module: set(names)}} as JSON: [[backends, {module: names}], ...]."""
    return [
        [sorted(backends), {m: sorted(names) for m, names in modules.items()}]
        for backends, modules in structure.items()
    ]


def _decode_structure(value) -> dict | None:
    """The inverse of `_encode_structure`; None when `value` is not such a list."""
    if not isinstance(value, list):
        return None
    structure = {}
    for entry in value:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_names(entry[0])):
            return None
        backends, modules = entry
        if not isinstance(modules, dict) or not all(_is_names(names) for names in modules.values()):
            return None
        structure[frozenset(backends)] = {m: set(names) for m, names in modules.items()}
    return structure


def _is_names(value) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)
