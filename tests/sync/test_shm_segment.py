"""The shared-memory segment of the CPU sync path: peers write into the sender's segment, files never leak."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

from megatron_agent.sync.transports import SEGMENT_PREFIX, BucketBuffer, open_bucket, release_buckets, shm_dir


def _peer_writes(path: str, nbytes: int) -> None:
    peer = BucketBuffer(nbytes, shared=True, device="cpu", attach=path)
    peer.u8[nbytes // 2 :].fill_(7)  # the peer's half
    peer.close()


def test_peer_process_writes_into_the_senders_segment_and_engine_reads_a_slot():
    seg = BucketBuffer(1 << 16, shared=True, device="cpu")
    path = seg.path
    try:
        seg.u8[: 1 << 15].fill_(3)
        proc = mp.get_context("spawn").Process(target=_peer_writes, args=(path, 1 << 16))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        assert os.path.exists(path), "a peer's close must not unlink the sender's segment"
        payload = seg.payload("shm", 1 << 14, offset=(1 << 15) - (1 << 13))
        view = open_bucket(payload)
        assert view.numel() == 1 << 14
        assert torch.equal(view[: 1 << 13], torch.full((1 << 13,), 3, dtype=torch.uint8))
        assert torch.equal(view[1 << 13 :], torch.full((1 << 13,), 7, dtype=torch.uint8))
        del view
        release_buckets()
    finally:
        seg.close()
    assert not os.path.exists(path)


def test_dropped_buffer_unlinks_its_file():
    seg = BucketBuffer(4096, shared=True, device="cpu")
    path = seg.path
    del seg
    assert not os.path.exists(path)


def test_files_of_dead_senders_are_removed():
    from megatron_agent.sync.transports import remove_stale_segments

    proc = mp.get_context("spawn").Process(target=int)
    proc.start()
    proc.join(60)
    dead = os.path.join(shm_dir(), f"{SEGMENT_PREFIX}{proc.pid}-0")
    alive = BucketBuffer(4096, shared=True, device="cpu")
    try:
        with open(dead, "wb") as f:
            f.write(b"x")
        assert remove_stale_segments() >= 1
        assert not os.path.exists(dead)
        assert os.path.exists(alive.path), "a live sender's segment is kept"
    finally:
        alive.close()
        if os.path.exists(dead):
            os.unlink(dead)


def test_engine_keeps_a_segment_mapped_between_syncs_but_never_a_replaced_or_freed_one():
    from megatron_agent.sync import transports

    release_buckets()
    seg = BucketBuffer(1 << 16, shared=True, device="cpu")
    path = seg.path
    try:
        seg.u8.fill_(1)
        first = open_bucket(seg.payload("shm", 1 << 10))
        ptr = first.data_ptr()
        del first
        release_buckets(keep_live=True)  # end of sync 1: the map stays
        seg.u8.fill_(2)  # sync 2 rewrites the segment in place
        second = open_bucket(seg.payload("shm", 1 << 10))
        assert second.data_ptr() == ptr, "the map was rebuilt although the segment is the same"
        assert int(second[0]) == 2, "a kept map must show the sender's new bytes"
        del second

        # The sender is replaced by one whose segment has the same name (a reused pid): the old
        # map must not be read as the new file.
        seg.close()
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 16)
        os.pwrite(fd, b"\x09" * 16, 0)
        os.close(fd)
        third = open_bucket({"kind": "shm", "path": path, "nbytes": 1 << 16, "offset": 0, "length": 16})
        assert torch.equal(third, torch.full((16,), 9, dtype=torch.uint8)), "read the replaced file's old map"
        del third
        release_buckets(keep_live=True)  # its file is still there: kept
        assert path in transports._OPEN_MAPS
        os.unlink(path)  # the sender freed its segment: the engine must not keep its pages alive
        release_buckets(keep_live=True)
        assert path not in transports._OPEN_MAPS
    finally:
        release_buckets()
        seg.close()
        if os.path.exists(path):
            os.unlink(path)


def test_checksum_work_is_split_by_bytes_and_survives_the_int64_all_reduce():
    from megatron_agent.sync.shm_stream import _to_int64, split_by_bytes

    sizes = [98, 4, 12, 6, 4, 12, 6, 1]
    owner = split_by_bytes(sizes, 2)
    assert owner == split_by_bytes(sizes, 2)  # the same on every TP rank
    load = [sum(n for n, o in zip(sizes, owner) if o == p) for p in (0, 1)]
    assert sorted(load) == [45, 98]  # the largest alone, everything else on the other rank
    assert split_by_bytes(sizes, 1) == [0] * len(sizes)
    for digest in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        packed = torch.tensor([_to_int64(digest)], dtype=torch.int64) + torch.zeros(1, dtype=torch.int64)
        assert int(packed.item()) % (1 << 64) == digest
