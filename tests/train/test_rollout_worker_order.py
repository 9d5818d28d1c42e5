"""The workers are ordinary (threaded) Ray actors, whose calls run in the order each caller made
them: the weight sync relies on it (a `finish` must not overtake the `load_bucket` before it).

A class with any `async def` method becomes an asyncio actor, for which Ray allows out-of-order
execution; it happened to RolloutWorker once (its coroutines were methods), and a sync failed
with "1 of 1 buckets never reached the engine" about once in a few hundred syncs."""

from __future__ import annotations

import pytest
from ray._private.async_compat import has_async_methods

from megatron_agent.train.megatron_worker import MegatronWorker
from megatron_agent.train.rollout_worker import RolloutWorker


@pytest.mark.parametrize("worker_cls", [RolloutWorker, MegatronWorker])
def test_workers_keep_their_callers_order(worker_cls):
    assert not has_async_methods(worker_cls), f"{worker_cls.__name__} would be an asyncio actor"


def test_the_check_sees_a_coroutine_method():
    class WithCoroutine:
        async def _private(self):
            return None

    assert has_async_methods(WithCoroutine)
