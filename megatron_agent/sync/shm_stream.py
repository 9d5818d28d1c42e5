"""The CPU sync path: TP ranks write their shards straight into one shared-memory segment.

Used when every engine of a sender is reached through CPU memory (`shm`, or `direct` for an
engine in the sender's process). Instead of a TP gather through the process group (gloo over TCP
moved 0.22 GB/s on the benchmark machine, 70% of the sync), every TP rank of the sending replica
copies its own shard into the full HF tensors in the segment (`layout.py`: QKV interleave,
gate/up fusion and vocabulary padding undone in the copy, a strided region per shard). Per bucket:

1. (bucket >= 2) the sender waits until every engine loaded the bucket that used the same slot;
   a tiny all-reduce over the TP group (also carrying error flags) lets the peers write;
2. every TP rank writes its runs of the bucket; a second tiny all-reduce says they all did;
3. every TP rank checksums its share of the bucket's tensors (XXH3; split by bytes), one more
   tiny all-reduce brings all the checksums to the sender, which hands the bucket to every engine
   by name (the sender alone took 0.034 s per sync of the benchmark model, before the engine
   could start on each bucket).

The segment holds two bucket slots (one when the stage fits in a bucket), so at most two buckets
are in flight and nobody holds more than two buckets beyond its own shards. It is created and
pre-faulted once (fresh shared-memory pages cost 0.7 GB/s here, more than the copy itself) and
reused by every sync: each sync rewrites every byte of every tensor (the layout checks that the
ranks' runs fill each tensor exactly once), the checksums are taken over what was written in
this sync, and the probe checks the result. `WeightSender.close()` unlinks it; files of dead
senders are removed when a new segment is created.
"""

from __future__ import annotations

import time

import torch

from megatron_agent.sync.buckets import BucketHeader, SyncError, TensorEntry, checksum
from megatron_agent.sync.layout import StagePlan, build_plan, write_bucket
from megatron_agent.sync.transports import BucketBuffer, remove_stale_segments
from megatron_agent.weights.export import unwrap


class SharedStream:
    """One stage's TP ranks (of the sending replica) streaming through a shared segment.

    `algo`: the sender's checksum algorithm ('' without verification), known to every TP rank."""

    def __init__(self, sender, algo: str):
        from megatron.core import parallel_state as ps

        self.s = sender
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.src = ps.get_tensor_model_parallel_src_rank()
        self.algo = algo
        self.plan: StagePlan | None = None
        self.segment: BucketBuffer | None = None
        self.in_flight: list[list] = [[], []]
        self._plan_key = None

    # ------------------------------------------------------------------------------ collectives
    def _flag(self, error: bool) -> bool:
        """Tiny all-reduce over the TP group: True when any rank has an error (also a barrier)."""
        if self.group is None:
            return error
        import torch.distributed as dist

        t = torch.tensor([int(error)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def _setup(self, stats: dict) -> str | None:
        """Plan the layout and (re)create the segment when the bucket size changed (collective)."""
        key = (self.s.bucket_bytes, self.s.dtype)
        if key == self._plan_key:
            return None
        import torch.distributed as dist

        self.close()
        m = self.s.model
        self.plan = build_plan(
            m.chunks, m.arch, self.s.impl, self.tp_rank, self.tp, self.s.bucket_bytes, self.s.dtype
        )
        t0 = time.perf_counter()
        box: list = [None]
        if self.s.role.is_sender:
            remove_stale_segments()
            self.segment = BucketBuffer(self.plan.segment_bytes, shared=True, device="cpu")
            box = [self.segment.path]
        if self.group is not None:
            dist.broadcast_object_list(box, src=self.src, group=self.group)
        error = None
        if not self.s.role.is_sender:
            try:
                self.segment = BucketBuffer(self.plan.segment_bytes, shared=True, device="cpu", attach=box[0])
            except SyncError as e:
                error = f"actor rank {self.s.role.rank} cannot map the sender's segment: {e}"
        stats["alloc_s"] += time.perf_counter() - t0
        if self._flag(error is not None):
            self.close()
            return error or "a TP peer could not map the shared-memory segment (see its error)"
        self._plan_key = key
        return None

    # ------------------------------------------------------------------------------ one sync
    def stream(self, sync_id: int, stats: dict) -> tuple[str | None, dict]:
        """Collective over the TP group: write, checksum and send every bucket; (first error, manifest).

        The last buckets may still be loading: the sender calls `flush` before the sync finishes."""
        error = self._setup(stats)
        if error is not None:
            return error, {}
        plan, sender = self.plan, self.s.role.is_sender
        params = [dict(unwrap(c).named_parameters()) for c in self.s.model.chunks]
        in_flight = self.in_flight = [[], []]
        manifest: dict[tuple[int, int], list[str]] = {}
        failed = False
        for bucket in plan.buckets:
            slot = bucket.index % 2
            if bucket.index >= 2:
                if sender and not failed:
                    error = self._wait(in_flight, slot, stats) or error
                t0 = time.perf_counter()
                failed = self._flag(error is not None) or failed
                stats["barrier_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if not failed:
                write_bucket(bucket, plan, params, self.segment.u8)
            t1 = time.perf_counter()
            failed = self._flag(error is not None) or failed
            t2 = time.perf_counter()
            stats["pack_s"] += t1 - t0
            stats["barrier_s"] += t2 - t1
            entries = self._entries(bucket, stats) if not failed else []
            if sender and not failed:
                try:
                    header = self._header(sync_id, bucket.index, entries, stats)
                    in_flight[slot] = self._submit(header, plan.slot_offset(bucket.index))
                    manifest[header.key] = header.names()
                except SyncError as e:
                    error = str(e)
        return error, manifest

    def flush(self, stats: dict) -> str | None:
        """Sender: wait until every engine loaded the buckets still in flight; the first error."""
        error = None
        for slot in (0, 1):
            error = self._wait(self.in_flight, slot, stats) or error
        return error

    def _entries(self, bucket, stats: dict) -> list[TensorEntry]:
        """The header entries of the bucket just written, with checksums when verifying.

        Collective over the TP group when verifying: each TP rank checksums its share
        (`split_by_bytes`); one all-reduce (SUM over values that only the owning rank set) gives
        every rank all of them."""
        algo, entries = self.algo, bucket.entries(self.s.dtype)
        if not algo:
            return entries
        t0 = time.perf_counter()
        owner = split_by_bytes([e.nbytes for e in entries], self.tp)
        values = torch.zeros(len(entries), dtype=torch.int64)
        base, u8 = self.plan.slot_offset(bucket.index), self.segment.u8
        for i, e in enumerate(entries):
            if owner[i] == self.tp_rank:
                start = base + e.offset
                values[i] = _to_int64(checksum(u8[start : start + e.nbytes], algo))
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        stats["checksum_s"] += time.perf_counter() - t0
        return [
            TensorEntry(e.name, e.shape, e.dtype, e.offset, e.nbytes, v % (1 << 64))
            for e, v in zip(entries, values.tolist(), strict=True)
        ]

    def _header(self, sync_id: int, index: int, entries: list[TensorEntry], stats: dict) -> BucketHeader:
        header = BucketHeader(sync_id, self.s.role.rank, index, self.algo)
        header.entries.extend(entries)
        stats["bytes"] += header.payload_bytes
        stats["num_buckets"] += 1
        return header

    def _submit(self, header: BucketHeader, offset: int) -> list:
        nbytes = header.nbytes
        return [
            ep.call("load_bucket", header, self.segment.payload(transport, nbytes, offset), self.s.cfg.verify)
            for ep, transport in zip(self.s.endpoints, self.s.transports)
        ]

    def _wait(self, in_flight: list[list], slot: int, stats: dict) -> str | None:
        t0 = time.perf_counter()
        calls, in_flight[slot] = in_flight[slot], []
        try:
            for call in calls:
                r = call.result(self.s.cfg.timeout_s)
                stats["engine_checksum_s"] += r["checksum_s"]
                stats["engine_load_s"] += r["load_s"]
        except SyncError as e:
            return str(e)
        finally:
            stats["wait_s"] += time.perf_counter() - t0
        return None

    def close(self) -> None:
        """Unmap the segment (and unlink it, on the sender)."""
        if self.segment is not None:
            self.segment.close()
        self.segment = None
        self._plan_key = None


def split_by_bytes(sizes: list[int], parts: int) -> list[int]:
    """Owner (0..parts-1) of each item: largest first, each to the least loaded part (deterministic)."""
    load = [0] * parts
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(parts), key=lambda p: (load[p], p))
        owner[i] = p
        load[p] += sizes[i]
    return owner


def _to_int64(value: int) -> int:
    """An unsigned 64-bit checksum (XXH3, CRC-32) as the signed value an int64 tensor holds."""
    return value - (1 << 64) if value >= 1 << 63 else value
