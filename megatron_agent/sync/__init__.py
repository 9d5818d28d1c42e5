"""Megatron -> rollout engine weight sync: bucketed, transport-agnostic, verified every time.

Actor side (every Megatron rank): `WeightSender(model, cfg.sync, endpoints).sync()`.
Engine side: `WeightReceiver(engine).handle(method, *args, **kwargs)` behind an endpoint
(`LocalEndpoint`, `SubprocessEndpoint`, `RayEndpoint`). See docs/sync.md.
"""

from megatron_agent.sync.buckets import SyncError
from megatron_agent.sync.endpoints import EngineCall, LocalEndpoint, RayEndpoint, SubprocessEndpoint
from megatron_agent.sync.receiver import WeightReceiver
from megatron_agent.sync.sender import WeightSender

__all__ = [
    "EngineCall",
    "LocalEndpoint",
    "RayEndpoint",
    "SubprocessEndpoint",
    "SyncError",
    "WeightReceiver",
    "WeightSender",
]
