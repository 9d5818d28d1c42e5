"""The streaming writers' overlapped I/O: background flushes of safetensors shards, and
checksums computed while a checkpoint is still being written."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from megatron_agent.checkpoint import manifest as manifest_mod
from megatron_agent.checkpoint.manifest import BackgroundHasher, verify_manifest, write_manifest
from megatron_agent.weights import hf_write
from megatron_agent.weights.hf_write import ShardedSafetensorsWriter, TensorSpec


def test_background_flushes_leave_shards_bit_exact(tmp_path, monkeypatch):
    synced = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd)))
    monkeypatch.setattr(hf_write, "FLUSH_BYTES", 4096)
    gen = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(64, 32, generator=gen) for i in range(6)}  # 8 KiB each
    plan = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = ShardedSafetensorsWriter(tmp_path, plan, max_shard_bytes=3 * 8192)
    for name, t in tensors.items():
        writer.write(name, t)
    files = writer.close()
    assert len(files) == 2 and synced, "expected two shards and background flushes"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    loaded = {}
    for f in files:
        loaded.update(load_file(tmp_path / f))
    assert set(loaded) == set(tensors) == set(index["weight_map"])
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_background_hashes_are_the_manifest_and_are_not_recomputed(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    (root / "model").mkdir(parents=True)
    with BackgroundHasher(workers=2) as hasher:
        for i in range(5):
            path = root / "model" / f"__0_{i}.distcp"
            path.write_bytes(os.urandom(10_000 + i))
            hasher.submit(path)
        (root / "meta.json").write_text("{}")
        known = hasher.digests(root)
    assert sorted(known) == [f"model/__0_{i}.distcp" for i in range(5)]

    hashed = []
    real = manifest_mod.sha256_file
    monkeypatch.setattr(
        manifest_mod, "sha256_file", lambda p, **kw: (hashed.append(p.name), real(p, **kw))[1]
    )
    with_known = write_manifest(root, known=known)
    assert hashed == ["meta.json"], "files hashed in the background were read again"
    hashed.clear()
    assert write_manifest(root) == with_known  # a full pass gives the same manifest
    verify_manifest(root)
