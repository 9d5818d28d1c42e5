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
