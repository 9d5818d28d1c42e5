"""A package's names imported from their modules on first use (PEP 562), so that importing one
light module of a package does not run the heavy ones its `__init__` re-exports."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, module_of: dict[str, str]) -> tuple[Callable, Callable]:
    """`(__getattr__, __dir__)` for `package`'s `__init__`: `package.<name>` imports
    `package.<module_of[name]>` on first use and returns its `name` (kept in the package after)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later lookups find it directly
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return __getattr__, __dir__
