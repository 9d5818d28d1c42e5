"""GPU only: a bucket passed as a CUDA IPC handle reaches another process bit-identically, and its
checksum names the tensor of a bucket corrupted after packing.

The engine side runs in a spawned process (as a vLLM worker would): it opens the handle
(`transports.open_bucket`), checks every entry (`buckets.first_bad_entry`) and sends the tensors
back as CPU copies. The bucket holds BF16 tensors and an FP8-quantized unit (weights + scales).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _engine(requests, replies):
    from megatron_agent.sync.buckets import first_bad_entry, iter_views
    from megatron_agent.sync.transports import open_bucket

    while (msg := requests.get()) is not None:
        header, payload = msg
        u8 = open_bucket(payload)
        assert u8.is_cuda
        bad = first_bad_entry(u8, header)
        tensors = {name: t.cpu().clone() for name, t in iter_views(u8, header)}
        torch.cuda.synchronize()
        replies.put((None if bad is None else bad[0].name, tensors))


def _bucket():
    from megatron_agent.quant.formats import FORMATS
    from megatron_agent.sync.buckets import BucketHeader, BucketWriter, default_algo, units_nbytes
    from megatron_agent.sync.quantizer import RolloutQuantizer, wire_dtype
    from megatron_agent.sync.transports import BucketBuffer

    g = torch.Generator(device="cuda").manual_seed(0)
    unit = [
        ("model.embed_tokens.weight", torch.randn(400, 64, device="cuda", generator=g)),
        ("model.layers.0.input_layernorm.weight", torch.randn(64, device="cuda", generator=g)),
    ]
    unit += RolloutQuantizer("fp8", FORMATS["fp8"], qdq=False).quantize_unit(
        [("model.layers.0.mlp.down_proj.weight", torch.randn(64, 256, device="cuda", generator=g))]
    )
    buf = BucketBuffer(units_nbytes(unit, torch.bfloat16), shared=False, device="cuda")
    header = BucketHeader(sync_id=1, sender=0, index=0, algo=default_algo(torch.device("cuda")))
    writer = BucketWriter(buf.u8, header, torch.bfloat16)
    for name, t in unit:
        writer.add(name, t)
    torch.cuda.synchronize()
    expected = {name: t.to(wire_dtype(name, t, torch.bfloat16)).cpu() for name, t in unit}
    return buf, header, expected


def test_cuda_ipc_bucket_is_bit_identical_and_corruption_is_caught():
    buf, header, expected = _bucket()
    assert header.algo == "wsum64"
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=_engine, args=(requests, replies), daemon=True)
    engine.start()
    try:
        requests.put((header, buf.payload("cuda_ipc", header.nbytes)))
        bad, got = replies.get(timeout=180)
        assert bad is None
        assert list(got) == header.names()
        for name, want in expected.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            a, b = got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
            assert torch.equal(a, b), f"{name} differs after CUDA IPC"
        # Corrupt one byte of the FP8 weight in place, after its checksum was recorded.
        victim = next(e for e in header.entries if e.name == "model.layers.0.mlp.down_proj.weight")
        buf.u8[victim.offset + 17] ^= 0x40
        torch.cuda.synchronize()
        requests.put((header, buf.payload("cuda_ipc", header.nbytes)))
        bad, _ = replies.get(timeout=180)
        assert bad == victim.name
    finally:
        requests.put(None)
        engine.join(60)
        if engine.is_alive():
            engine.kill()
        buf.close()
