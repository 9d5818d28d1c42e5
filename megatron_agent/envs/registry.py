"""Name -> object lookup for tools and reward functions, built-in or by dotted path."""

from __future__ import annotations

import importlib
from typing import Any

from megatron_agent.errors import InputError


def load_object(path: str) -> Any:
    """The object at `package.module:attr` or `package.module.attr`; ValueError naming the path."""
    if ":" in path:
        module_name, attr = path.split(":", 1)
    elif "." in path:
        module_name, attr = path.rsplit(".", 1)
    else:
        raise InputError(f"{path!r} is not a dotted path (package.module.name)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"cannot import module {module_name!r} for {path!r}: {exc}") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise InputError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
    return obj
