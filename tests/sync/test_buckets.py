"""Bucket packing, checksums and transport choice (in-process, no engine)."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.sync.buckets import (
    BucketHeader,
    BucketWriter,
    checksum,
    first_bad_entry,
    iter_views,
    units_nbytes,
)
from megatron_agent.sync.producer import unit_key
from megatron_agent.sync.transports import (
    BucketBuffer,
    choose_transport,
    host_id,
    open_bucket,
    release_buckets,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(7, 5, generator=g)),
        ("b.bias", torch.randn(3, generator=g)),
        ("c.weight", torch.randn(2, 3, 4, generator=g)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_pack_and_read_back(dtype, shared):
    tensors = _tensors()
    buf = BucketBuffer(units_nbytes(tensors, dtype), shared=shared, device="cpu")
    try:
        header = BucketHeader(sync_id=1, sender=0, index=0, algo="crc32")
        writer = BucketWriter(buf.u8, header, dtype)
        for name, t in tensors:
            writer.add(name, t)
        assert not writer.fits(1)  # sized exactly (with alignment)
        payload = buf.payload("shm" if shared else "direct", header.nbytes)
        assert "tensor" not in payload or not shared  # shared memory goes by name, never by value
        got = dict(iter_views(open_bucket(payload), header))
        assert list(got) == [n for n, _ in tensors]
        for name, t in tensors:
            assert got[name].dtype == dtype
            assert torch.equal(got[name], t.to(dtype)), name
        assert first_bad_entry(open_bucket(payload), header) is None
    finally:
        release_buckets()
        buf.close()


def test_checksum_names_the_corrupted_tensor():
    tensors = _tensors()
    buf = BucketBuffer(units_nbytes(tensors, torch.float32), shared=True, device="cpu")
    try:
        header = BucketHeader(1, 0, 0, "crc32")
        writer = BucketWriter(buf.u8, header, torch.float32)
        for name, t in tensors:
            writer.add(name, t)
        e = header.entries[2]
        buf.u8[e.offset + 5] ^= 1  # one bit, in the last tensor
        bad = first_bad_entry(open_bucket(buf.payload("shm", header.nbytes)), header)
        assert bad is not None and bad[0].name == "c.weight" and bad[1] != e.checksum
    finally:
        release_buckets()
        buf.close()


def test_weighted_sum_detects_swapped_words():
    x = torch.arange(64, dtype=torch.uint8)
    y = x.clone()
    y[:4], y[4:8] = x[4:8].clone(), x[:4].clone()  # same bytes, other order
    assert checksum(x, "wsum64") != checksum(y, "wsum64")
    assert checksum(x, "wsum64") == checksum(x.clone(), "wsum64")


def test_units_keep_vllm_modules_whole():
    assert unit_key("model.layers.3.self_attn.k_proj.bias")[0] == "model.layers.3.qkv"
    assert unit_key("model.layers.3.self_attn.q_proj.weight")[0] == "model.layers.3.qkv"
    assert unit_key("model.layers.3.mlp.up_proj.weight") == ("model.layers.3.gate_up", 2)
    assert unit_key("model.layers.3.self_attn.o_proj.weight") == ("model.layers.3.self_attn.o_proj.weight", 1)


def test_transport_choice():
    here = {"host": host_id(), "device": "cpu"}
    assert choose_transport("auto", local=True, engine_info=here) == "direct"
    assert choose_transport("auto", local=False, engine_info=here) == "shm"
    with pytest.raises(ValueError, match="no transport"):
        choose_transport("auto", local=False, engine_info={"host": "elsewhere/0", "device": "cpu"})
    with pytest.raises(ValueError, match="sync.transport=direct"):
        choose_transport("direct", local=False, engine_info=here)
    with pytest.raises(ValueError, match="choose auto"):
        choose_transport("pigeon", local=False, engine_info=here)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            choose_transport("cuda_ipc", local=False, engine_info=here)
