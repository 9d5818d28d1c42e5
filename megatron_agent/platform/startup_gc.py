"""Python's garbage collector while a worker imports its libraries: the import graph walked once.

A rollout engine's start is mostly imports (vLLM with transformers, pydantic schemas, openai's
types: millions of objects), and what they create lives as long as the process. Python's cyclic
collector still walks all of it, again and again: automatic collections fire every 700
allocations while the modules load, and vLLM calls `gc.collect()` five times while it builds an
engine (about 0.2 s each on 2 CPU cores); none of them finds garbage worth the time.

An engine's process (`train/rollout_worker.py`, `sync/server.py`) opts in with `imports_begin()`,
which raises the collector's first threshold for the import phase; `imports_end()` (a no-op in a
process that did not opt in, such as a test's or the driver's; `VLLMEngine` calls it once vLLM is
imported) collects once (so no garbage is kept), moves every surviving object to the permanent
generation (`gc.freeze`: later collections skip those objects; reference counting still frees them)
and restores the thresholds. Call it once the imports are done and before a model is built: a frozen
object in a reference cycle is never collected, so a model replaced later (the critic rebuilt after
SFT, say) would keep its memory. Measured: docs/lean.md.
"""

from __future__ import annotations

import gc

IMPORT_THRESHOLD = 100_000  # allocations between two young collections while modules load
_saved: tuple[int, int, int] | None = None


def imports_begin() -> None:
    """Collect rarely until `imports_end` (a no-op when begun already)."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(max(IMPORT_THRESHOLD, _saved[0]), _saved[1], _saved[2])


def imports_end(freeze: bool = True) -> None:
    """After `imports_begin`: collect once, freeze what survives (the modules and what they hold),
    restore the thresholds. Without it: nothing. `freeze=False` only restores the thresholds: the
    entry point's safety net once its engine is built (an engine other than vLLM's, which does
    not end the phase itself, leaves nothing frozen and the usual collections back)."""
    global _saved
    if _saved is None:
        return
    if freeze:
        gc.collect()
        gc.freeze()
    gc.set_threshold(*_saved)
    _saved = None
