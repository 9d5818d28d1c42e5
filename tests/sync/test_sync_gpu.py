"""GPU transports: CUDA IPC (colocated) and NCCL (engine on another GPU), end to end with vLLM on GPU."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_torchrun

pytestmark = pytest.mark.gpu


def _cuda_ipc_child(handle, nbytes, q):

    from megatron_agent.sync.buckets import checksum
    from megatron_agent.sync.transports import open_bucket

    u8 = open_bucket({"kind": "cuda_ipc", "handle": handle, "nbytes": nbytes})
    q.put(checksum(u8, "wsum64"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_bucket_is_read_in_place_by_another_process():
    import multiprocessing as mp

    from megatron_agent.sync.buckets import checksum
    from megatron_agent.sync.transports import BucketBuffer

    buf = BucketBuffer(1 << 20, shared=False, device="cuda")
    buf.u8.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    payload = buf.payload("cuda_ipc", 1000)
    p = ctx.Process(target=_cuda_ipc_child, args=(payload["handle"], 1000, q))
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    assert got == checksum(buf.u8[:1000], "wsum64")


@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_sync_over_gpu_transport(transport, tiny_models, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL weight sync needs the engine on a second GPU")
    run_torchrun(
        [
            "tests/sync/sync_worker.py",
            "--mode",
            "gpu",
            "--transport",
            transport,
            "--model",
            str(tiny_models["qwen2"]),
            "--out-dir",
            str(tmp_path),
            "--cache",
            str(tmp_path),
        ],
        nproc=1,
    )
    metrics = json.loads((tmp_path / f"gpu_{transport}.json").read_text())["metrics"]
    assert [m["sync/weight_version"] for m in metrics] == [1.0, 2.0]
    assert all(m["sync/verified"] == 1.0 for m in metrics)
