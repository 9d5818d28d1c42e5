"""The per-user cache folder of megatron-agent (what a run can make once per machine and reuse)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MEGATRON_AGENT_CACHE"


def cache_dir() -> Path:
    """$MEGATRON_AGENT_CACHE, else $XDG_CACHE_HOME/megatron_agent, else ~/.cache/megatron_agent."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "megatron_agent"


def read_json(path: str | os.PathLike):
    """The JSON value in the cache file `path`; None when it is absent or cannot be read as JSON
    (a cache file only saves time: the caller computes what it would have held)."""
    import json

    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: str | os.PathLike, value, **dump_options) -> bool:
    """Write `value` as JSON to the cache file `path`, whole and atomically (a reader sees the
    old file or the new one), its folder made first; False, and nothing left behind, when it
    cannot be written."""
    import json
    import tempfile

    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, **dump_options)
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError:
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
