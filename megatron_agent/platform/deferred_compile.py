"""`torch.compile` deferred to a function's first call, for a library that compiles as it imports.

megatron-core decorates its fused kernels (bias + GeLU, SwiGLU, rotary, ...) with
`torch.compile` when its modules import. Compiling is lazy, but `torch.compile(fn)` itself imports
TorchDynamo's backends and Inductor's compiler (compile_fx, its autotuner, sympy, networkx, ...)
at once: 1.2-1.6 s of every Megatron rank's start on 2 cores and about 43 MB, while on CPU those
kernels are never called (the fusions are off there: `models/build.py`). Within
`deferred_torch_compile()`, `torch.compile(fn)` of a plain function returns a wrapper that calls
the real `torch.compile(fn, **options)` at its first call and the compiled function from then on:
what a call computes is unchanged, only the cost of setting it up moves to where it is used.
Modules (and anything not a plain function) are compiled as before; after the block
`torch.compile` is torch's own again.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch


def deferred(compile_fn: Callable) -> Callable:
    """A `torch.compile` stand-in that defers `compile_fn(fn, **options)` to `fn`'s first call."""

    def compile_later(model=None, **options):
        if model is None:  # the decorator form: torch.compile(mode=...)(fn)
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):
            return compile_fn(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_later


@contextlib.contextmanager
def deferred_torch_compile(enabled: bool = True) -> Iterator[None]:
    """Within the block, `torch.compile` of a plain function compiles at its first call (above);
    `enabled=False`: nothing changes."""
    if not enabled:
        yield
        return
    original = torch.compile
    torch.compile = deferred(original)
    try:
        yield
    finally:
        torch.compile = original
