"""RayEndpoint with a real local Ray actor: buckets by shared memory, errors and death as SyncError."""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import pytest
import torch

from megatron_agent.sync import RayEndpoint, SyncError
from megatron_agent.sync.buckets import BucketHeader, BucketWriter, units_nbytes
from megatron_agent.sync.transports import BucketBuffer, choose_transport
from tests.conftest import REPO


class _RecordingEngine:
    def __init__(self):
        self.weight_version = 0
        self.tensors = {}

    def update_weights(self, named_tensors):
        self.tensors.update({n: t.clone() for n, t in named_tensors})
        self.weight_version += 1


class _EngineActor:
    def __init__(self):
        from megatron_agent.sync import WeightReceiver

        self.receiver = WeightReceiver(_RecordingEngine())

    def sync_call(self, method, *args, **kwargs):
        if method == "sleep":  # a test hook: an engine that stops answering
            time.sleep(args[0])
            return None
        return self.receiver.handle(method, *args, **kwargs)

    def recorded(self):
        return self.receiver.engine.tensors

    def pid(self):
        return os.getpid()


@pytest.fixture(scope="module")
def ray_actor():
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
        log_to_driver=False,
    )
    try:
        yield ray.remote(_EngineActor).options(max_concurrency=2).remote()
    finally:
        ray.shutdown()


def _bucket(tensors, corrupt=False):
    buf = BucketBuffer(units_nbytes(tensors, torch.bfloat16), shared=True, device="cpu")
    header = BucketHeader(1, 0, 0, "crc32")
    writer = BucketWriter(buf.u8, header, torch.bfloat16)
    for name, t in tensors:
        writer.add(name, t)
    if corrupt:
        buf.u8[header.entries[1].offset] ^= 4
    return buf, header


def test_ray_endpoint(ray_actor):
    import ray

    ep = RayEndpoint(ray_actor, name="engine actor")
    info = ep.call("info").result(60)
    assert choose_transport("auto", local=False, engine_info=info) == "shm"
    tensors = [("x.weight", torch.randn(16, 8)), ("y.weight", torch.randn(5))]
    buf, header = _bucket(tensors)
    try:
        ep.call("load_bucket", header, buf.payload("shm", header.nbytes), True).result(60)
        assert ep.call("finish", 1, {header.key: header.names()}).result(60) == 1
    finally:
        buf.close()
    got = ray.get(ray_actor.recorded.remote())
    for name, t in tensors:
        assert torch.equal(got[name], t.to(torch.bfloat16)), name

    bad, header = _bucket(tensors, corrupt=True)
    try:
        with pytest.raises(SyncError, match="tensor y.weight"):
            ep.call("load_bucket", header, bad.payload("shm", header.nbytes), True).result(60)
    finally:
        bad.close()

    t0 = time.perf_counter()
    with pytest.raises(SyncError, match="engine actor did not answer 'sleep' within 1 s"):
        ep.call("sleep", 30).result(1)
    assert time.perf_counter() - t0 < 10

    pid = ray.get(ray_actor.pid.remote())
    ray.kill(ray_actor)
    # ray.kill returns before the actor is gone, and a call that reaches it first is answered (the
    # actor has a free slot beside its 'sleep'): the call is made once its process has ended
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(timeout=60)
    with pytest.raises(SyncError, match="engine actor died during 'ping'"):
        ep.call("ping").result(60)
