"""Optional dependencies a process never uses, hidden while a library's import runs.

vLLM, transformers and megatron-core probe for optional packages as they import, and import them
when found: a text-only vLLM engine on CPU loads triton (which has no CPU backend: vLLM then
disables it), scipy (for transformers' object-detection losses) and OpenCV (for vLLM's video
decoding); a Megatron rank loads wandb and TensorBoard for megatron-core's timers, which this
project never gives a writer. Each of those imports is guarded by its library (`try: import x
except ImportError`, or an availability check), so a hidden package takes the path the library
takes when it is not installed. Hiding is confined to a block: once it ends the packages import
normally again (a tool or reward that imports scipy later gets it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def hidden_imports(names: Iterable[str]) -> Iterator[list[str]]:
    """Within the block, `import NAME` (and `importlib.util.find_spec(NAME)`) behaves as if
    NAME were not installed, for each top-level NAME not imported yet; yields those names.
    After the block they import normally; what imported while they were hidden keeps the
    fallback it chose."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # the import system's "not importable" marker
    try:
        yield hidden
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
