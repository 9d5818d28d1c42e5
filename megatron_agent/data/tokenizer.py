"""The model's tokenizer, built without transformers' Auto registry once its class is known.

`AutoTokenizer.from_pretrained` chooses a tokenizer class from the folder's tokenizer_config.json
and config.json, with tables of exceptions per model type, and to read those tables it imports
transformers' model registry, and through it `torch._dynamo`, inductor and triton: in a process
that only tokenizes (the run's driver) that is 1.5-2 s of start-up and 150 MB resident.

The class it chooses is a function of the folder (its file names, tokenizer_config.json and
config.json, and a relative path's text) and of the transformers version. `load_tokenizer`
records the choice in a per-user cache (`~/.cache/megatron_agent`, or `$MEGATRON_AGENT_CACHE`),
keyed by a digest of all of those, and the next time builds the recorded class directly: the same
`from_pretrained(path)` that AutoTokenizer calls once it has chosen. A changed file, another
transformers, a folder with remote code (`auto_map`), a path that is not a local folder or a
cache that cannot be read: the usual AutoTokenizer, whose choice is then recorded.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

from megatron_agent.platform.user_cache import cache_dir, read_json, write_json

_CACHE_FILE = "tokenizer_classes.json"
_MAX_ENTRIES = 256  # the oldest choices are dropped beyond this
_CONFIG_FILES = ("tokenizer_config.json", "config.json")


def folder_key(path: str | os.PathLike) -> str | None:
    """The digest of what AutoTokenizer's choice of class depends on for the folder `path`; None
    when the choice must not be recorded (not a local folder, remote code in either config)."""
    import transformers

    folder = Path(path)
    if not folder.is_dir():
        return None
    # The path matters only through AutoTokenizer's patterns of hub ids ("org/name-*"), which a
    # relative path may match and an absolute one cannot: absolute paths share their records.
    where = "<absolute>" if os.path.isabs(path) else str(path)
    digest = hashlib.sha256()
    for part in (transformers.__version__, where, *sorted(os.listdir(folder))):
        digest.update(part.encode() + b"\0")
    for name in _CONFIG_FILES:
        file = folder / name
        data = file.read_bytes() if file.is_file() else b"<absent>"
        if b'"auto_map"' in data:  # the class is the folder's own code
            return None
        digest.update(name.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer `AutoTokenizer.from_pretrained(path)` returns, built from its recorded class
    when this folder's choice is in the cache (see the module docstring)."""
    key = folder_key(path)
    cls = _recorded_class(key) if key else None
    if cls is not None:
        return cls.from_pretrained(str(path))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if key:
        _record(key, type(tokenizer))
    return tokenizer


def _class_name(cls: type) -> str | None:
    """The "module:qualname" of a class of transformers itself (nothing else is recorded)."""
    module = getattr(cls, "__module__", "")
    if not module.startswith("transformers.") or "<" in cls.__qualname__:
        return None
    return f"{module}:{cls.__qualname__}"


def _read_cache() -> dict[str, str]:
    entries = read_json(cache_dir() / _CACHE_FILE)
    return entries if isinstance(entries, dict) else {}


def _recorded_class(key: str) -> type | None:
    """The class recorded for `key`, imported; None when absent or no longer importable."""
    name = _read_cache().get(key)
    if not isinstance(name, str) or ":" not in name or not name.startswith("transformers."):
        return None
    module, _, qualname = name.partition(":")
    try:
        obj = importlib.import_module(module)
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) and hasattr(obj, "from_pretrained") else None


def _record(key: str, cls: type) -> None:
    """Add `key` -> `cls` to the cache (written whole and atomically; not written when the
    folder cannot be: the cache only saves time)."""
    name = _class_name(cls)
    if name is None:
        return
    entries = _read_cache()
    entries.pop(key, None)
    entries[key] = name
    entries = dict(list(entries.items())[-_MAX_ENTRIES:])
    write_json(cache_dir() / _CACHE_FILE, entries, indent=0)
