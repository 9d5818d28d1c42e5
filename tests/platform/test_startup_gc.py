"""The collector's settings for a worker's import phase (platform/startup_gc.py)."""

from __future__ import annotations

import gc
import weakref

from megatron_agent.platform import startup_gc


class _Node:
    """An object that can sit in a reference cycle and be watched through a weak reference."""

    def __init__(self):
        self.other = None


def test_imports_phase_collects_rarely_then_freezes_survivors_only_and_restores_thresholds():
    before = gc.get_threshold()
    try:
        startup_gc.imports_begin()
        assert gc.get_threshold()[0] == max(startup_gc.IMPORT_THRESHOLD, before[0])
        startup_gc.imports_begin()  # a second begin keeps the saved thresholds
        kept = _Node()
        garbage_a, garbage_b = _Node(), _Node()
        garbage_a.other, garbage_b.other = garbage_b, garbage_a  # a cycle: only the collector frees it
        watch = weakref.ref(garbage_a)
        del garbage_a, garbage_b
        frozen_before = gc.get_freeze_count()
        startup_gc.imports_end()
        assert gc.get_threshold() == before
        assert watch() is None  # collected before the freeze, not kept in the permanent generation
        assert gc.get_freeze_count() > frozen_before
        assert not any(o is kept for o in gc.get_objects())  # frozen: no longer tracked by collections
        assert kept.other is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_imports_end_does_nothing_in_a_process_that_did_not_opt_in():
    frozen, threshold = gc.get_freeze_count(), gc.get_threshold()
    startup_gc.imports_end()
    assert gc.get_freeze_count() == frozen and gc.get_threshold() == threshold


def test_an_entry_point_whose_engine_did_not_end_the_phase_gets_its_thresholds_back_unfrozen():
    # RolloutWorker and the sync server end the phase after the build with freeze=False: a stand-in
    # engine (not vLLM's) leaves no raised threshold and nothing frozen behind.
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        startup_gc.imports_begin()
        assert gc.get_threshold()[0] == max(startup_gc.IMPORT_THRESHOLD, before[0])
        startup_gc.imports_end(freeze=False)
        assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
        startup_gc.imports_end()  # ended: a no-op
        assert gc.get_freeze_count() == frozen
    finally:
        gc.set_threshold(*before)
