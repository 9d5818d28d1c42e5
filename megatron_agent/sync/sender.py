"""`WeightSender.sync()`: stream the actor's current weights into every rollout engine, then verify.

Collective: every actor rank calls it at the same time after the update. One rank per pipeline
stage (TP rank 0 of data-parallel replica 0) packs its stage's HF tensors into buckets of
`sync.bucket_mb` and sends every bucket to every engine, with at most two buckets in flight (the
next one is packed while the engines load the last). Then the first stage's sender checks with
each engine that every bucket arrived (`finish`: prefix cache reset, weight_version bumped once),
and, with `sync.verify`, the engine's prompt log-probs of fixed ids are compared with the actor's.
Any failure raises `SyncError` with the same message on every rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch

from megatron_agent.config import SyncConfig
from megatron_agent.models.build import resolve_transformer_impl
from megatron_agent.sync.buckets import BucketHeader, BucketWriter, SyncError, default_algo, units_nbytes
from megatron_agent.sync.producer import SyncRole, Unit, iter_units
from megatron_agent.sync.quantizer import quantized_probe_tolerance, rollout_quantizer
from megatron_agent.sync.transports import BucketBuffer, buffer_device, choose_transport
from megatron_agent.sync.verify import compare_probe, probe_sequences, probe_tolerance


class _Pipeline:
    """The sender's buckets: pack into one of two buffers while the engines load the other."""

    def __init__(self, sender: WeightSender, sync_id: int, stats: dict):
        self.s = sender
        self.sync_id = sync_id
        self.stats = stats
        self.buffers: list[BucketBuffer | None] = [None, None]
        self.in_flight: list[list] = [[], []]
        self.slot = 0
        self.writer: BucketWriter | None = None
        self.num_buckets = 0
        self.manifest: dict[tuple[int, int], list[str]] = {}

    def add(self, unit: Unit) -> None:
        """Pack one unit, first sending the current bucket if the unit does not fit in it."""
        need = units_nbytes(unit, self.s.dtype)
        if self.writer is not None and not self.writer.fits(need):
            self._submit()
        if self.writer is None:
            self._open(need)
        t0 = time.perf_counter()
        for name, tensor in unit:
            self.writer.add(name, tensor)
        self.stats["pack_s"] += time.perf_counter() - t0

    def _open(self, need: int) -> None:
        self._wait(self.slot)
        # A unit larger than a bucket travels alone; a model smaller than a bucket gets a buffer
        # of its own size (allocating and populating 256 MiB of shared memory per sync for a
        # few MiB of weights cost 0.18 s of a 0.33 s sync in bench/step.py).
        size = max(min(self.s.bucket_bytes, self.s.stage_bytes), need)
        buf = self.buffers[self.slot]
        if buf is None or buf.nbytes != size:
            if buf is not None:
                buf.close()
            t0 = time.perf_counter()
            buf = self.buffers[self.slot] = BucketBuffer(size, shared=self.s.shared, device=self.s.device)
            self.stats["alloc_s"] += time.perf_counter() - t0
        header = BucketHeader(self.sync_id, self.s.role.rank, self.num_buckets, self.s.algo)
        self.writer = BucketWriter(buf.u8, header, self.s.dtype)

    def _submit(self) -> None:
        header, buf = self.writer.header, self.buffers[self.slot]
        nbytes = header.nbytes
        calls = []
        for ep, transport in zip(self.s.endpoints, self.s.transports):
            payload = self.s.nccl.payload(nbytes) if transport == "nccl" else buf.payload(transport, nbytes)
            calls.append(ep.call("load_bucket", header, payload, self.s.cfg.verify))
        if self.s.nccl is not None:
            self.s.nccl.broadcast(buf.u8[:nbytes])
        self.in_flight[self.slot] = calls
        self.manifest[header.key] = header.names()
        self.stats["checksum_s"] += self.writer.checksum_s
        self.stats["bytes"] += header.payload_bytes
        self.stats["num_buckets"] += 1
        self.num_buckets += 1
        self.writer = None
        self.slot ^= 1

    def _wait(self, slot: int) -> None:
        t0 = time.perf_counter()
        calls, self.in_flight[slot] = self.in_flight[slot], []
        for call in calls:
            r = call.result(self.s.cfg.timeout_s)
            self.stats["engine_checksum_s"] += r["checksum_s"]
            self.stats["engine_load_s"] += r["load_s"]
        self.stats["wait_s"] += time.perf_counter() - t0

    def submit_last(self) -> None:
        """Send the last, partly filled bucket."""
        if self.writer is not None and self.writer.header.entries:
            self._submit()

    def flush(self) -> None:
        """Send the last bucket (if not yet sent) and wait until the engines loaded everything."""
        self.submit_last()
        self._wait(0)
        self._wait(1)

    def close(self) -> None:
        """Free both buffers (nothing of a sync outlives it)."""
        for buf in self.buffers:
            if buf is not None:
                buf.close()
        self.buffers = [None, None]


def _stage_bytes_bound(model, dtype: torch.dtype) -> int:
    """About the bytes this stage sends per sync: its parameters gathered over TP, plus header slack.

    Only sizes the buffers: an underestimate costs one more bucket, never correctness."""
    numel = sum(p.numel() for chunk in model.chunks for p in chunk.parameters())
    nbytes = numel * model.opts.tp * dtype.itemsize
    return nbytes + nbytes // 100 + (1 << 20)


class WeightSender:
    """Pushes a `MegatronModel`'s weights to rollout engine endpoints; constructed on every actor rank.

    `endpoints`: one per engine (every engine gets every bucket); ranks that do not send may get
    the same list and never use it. `rollout_dtype`: the dtype the engines run in.
    """

    def __init__(
        self, model, cfg: SyncConfig, endpoints: Sequence, rollout_dtype: torch.dtype = torch.float32
    ):
        self.model = model
        self.cfg = cfg
        self.endpoints = list(endpoints)
        self.dtype = rollout_dtype
        self.role = SyncRole.current()
        self.bucket_bytes = int(cfg.bucket_mb) << 20
        self.stage_bytes = _stage_bytes_bound(model, rollout_dtype)
        if self.bucket_bytes <= 0:
            raise ValueError(f"sync.bucket_mb={cfg.bucket_mb} must be positive")
        self.impl = resolve_transformer_impl(model.opts.transformer_impl)
        self.probe_ids = probe_sequences(model.arch.vocab_size)
        self.tol = probe_tolerance(rollout_dtype, cfg.probe_tol_fp32, cfg.probe_tol_bf16)
        self.num_syncs = 0
        self.transports: list[str] | None = None
        self.nccl = None
        self.quantizer = None  # a RolloutQuantizer when the engines serve quantized weights
        self._mode: str | None = None  # 'shm' or 'gather', agreed in the TP group at the first sync
        self._shared = None  # the SharedStream of the 'shm' mode
        if self.role.is_sender and not self.endpoints:
            raise ValueError("WeightSender on a sending rank needs at least one engine endpoint")

    # ------------------------------------------------------------------------------- setup
    def _connect(self) -> None:
        """Ask each engine where it lives and pick a transport for it (sending ranks, first sync)."""
        infos = [ep.call("info").result(self.cfg.timeout_s) for ep in self.endpoints]
        self.transports = [
            choose_transport(self.cfg.transport, local=bool(getattr(ep, "local", False)), engine_info=info)
            for ep, info in zip(self.endpoints, infos)
        ]
        self.quantizer = rollout_quantizer(infos)
        if self.quantizer is not None:
            self.tol = quantized_probe_tolerance(
                self.quantizer,
                self.model,
                self.tol,
                fp8_tol=self.cfg.probe_tol_fp8,
                nvfp4_tol=self.cfg.probe_tol_nvfp4,
            )
        kinds = set(self.transports)
        self.device = buffer_device(kinds)
        self.shared = "shm" in kinds
        self.algo = default_algo(torch.device(self.device)) if self.cfg.verify else ""
        if "nccl" in kinds:
            if kinds != {"nccl"}:
                raise ValueError("an NCCL sync cannot be mixed with other transports across engines")
            from megatron_agent.sync.nccl import NcclSender

            self.nccl = NcclSender(self.endpoints, infos, self.cfg.timeout_s)

    def _prepare(self) -> str | None:
        """First sync, sending replica: the sender connects; its TP group agrees on the path (collective).

        The shared-memory path (`shm_stream.py`: TP ranks write their shards into the segment) is
        taken when every engine is reached through CPU memory and serves the rollout dtype;
        otherwise the shards are gathered in the TP group and packed by the sender (`_Pipeline`)."""
        if self._mode is not None:
            return None
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        # (mode, error message, checksum algorithm): the TP peers of the shm path checksum their
        # share of every bucket with the sender's algorithm.
        decision: tuple[str, str | None, str] = ("gather", None, "")
        if self.role.is_sender:
            try:
                if self.transports is None:
                    self._connect()
                if (
                    self.device == "cpu"
                    and self.quantizer is None
                    and set(self.transports) <= {"shm", "direct"}
                ):
                    decision = ("shm", None, self.algo)
            except (SyncError, ValueError) as e:
                decision = (type(e).__name__, str(e), "")
        if ps.get_tensor_model_parallel_world_size() > 1:
            box = [decision]
            dist.broadcast_object_list(
                box, src=ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group()
            )
            decision = box[0]
        mode, message, algo = decision
        if mode == "ValueError":
            raise ValueError(message)
        if message is not None:
            return message
        self._mode = mode
        if mode == "shm":
            from megatron_agent.sync.shm_stream import SharedStream

            self._shared = SharedStream(self, algo)
        return None

    def close(self) -> None:
        """Free the shared-memory segment kept between syncs (the sender unlinks it); idempotent."""
        if self._shared is not None:
            self._shared.close()

    # ------------------------------------------------------------------------------- sync
    def sync(self, version: int | None = None) -> dict:
        """Collective: send the current weights to every engine, finish (the engines then label
        them `version`; default: one more than they had), and verify; returns metrics."""
        t_start = time.perf_counter()
        self.num_syncs += 1
        sync_id = self.num_syncs
        stats = dict.fromkeys(
            (
                "bytes",
                "num_buckets",
                "produce_s",
                "quantize_s",
                "pack_s",
                "alloc_s",
                "wait_s",
                "checksum_s",
                "engine_checksum_s",
                "engine_load_s",
                "barrier_s",
            ),
            0.0,
        )
        error, manifest = None, {}
        pipeline = None
        actor_probe: dict = {}
        early: tuple[list, list | None] | None = None  # finish and probe calls already sent
        try:
            if self.role.in_sending_replica:
                error = self._prepare()
            if error is None and self._shared is not None:
                error, manifest = self._shared.stream(sync_id, stats)
            elif error is None:
                if self.role.is_sender:
                    pipeline = _Pipeline(self, sync_id, stats)
                error = self._stream(pipeline, stats)
                if pipeline is not None and error is None:
                    pipeline.submit_last()
                    manifest = pipeline.manifest
            if error is None and self.role.is_leader and self._sole_sender():
                # One pipeline stage: this rank sent every bucket, so `finish` (and the probe
                # behind it) can follow the last bucket at once. Each engine runs its calls in
                # order, so it finishes and scores as soon as it has loaded, while the actor's
                # probe runs; a bucket that failed to load makes `finish` fail, as below.
                early = self._send_finish(sync_id, manifest, version)
            # The actor's side of the probe depends only on the actor's weights, which a sync does
            # not change: it runs (collectively, on every rank) while the engines load the last
            # buckets. Even on an oversubscribed CPU this is the faster order: on 2 cores with two
            # TP ranks and one engine (bench/sync.py), the probe forward took 0.13 s instead of
            # 0.09 s, but the sync 0.30 s instead of 0.37 s, as the engine's load no longer waits.
            if self.cfg.verify:
                actor_probe = self._actor_probe(one_thread=not torch.cuda.is_available())
            if error is None and self._shared is not None:
                error = self._shared.flush(stats)
            elif error is None and pipeline is not None:
                pipeline.flush()
        except SyncError as e:
            error = str(e)
        finally:
            if pipeline is not None:
                manifest = pipeline.manifest
                pipeline.close()
        states = self._agree({"error": error, "manifest": manifest, "stats": stats})
        _raise_first([s["error"] for s in states])
        t_sent = time.perf_counter()

        finish_error, version, probe_calls = None, None, None
        if self.role.is_leader:
            try:
                if early is None:
                    merged = {k: v for s in states for k, v in s["manifest"].items()}
                    early = self._send_finish(sync_id, merged, version)
                calls, probe_calls = early
                version = [c.result(self.cfg.timeout_s) for c in calls][0]
            except SyncError as e:
                finish_error = str(e)
        t_finished = time.perf_counter()
        result = dict(actor_probe)
        if self.cfg.verify and self.role.is_leader:
            result.update(self._engine_probe(probe_calls) if finish_error is None else {"tol": self.tol})
        mine = {"error": finish_error, "version": version, **result}
        if self.role.is_leader:
            mine["times"] = (t_start, t_sent, t_finished, time.perf_counter())
        states2 = self._agree(mine)
        _raise_first([s["error"] for s in states2])
        return self._metrics(states, states2)

    def _sole_sender(self) -> bool:
        """Whether this stage is the only one (so its sender sent every bucket of the sync)."""
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_world_size() == 1

    def _send_finish(self, sync_id: int, manifest: dict, version: int | None) -> tuple[list, list | None]:
        """Leader: send `finish` with the sync's full manifest to every engine, and the probe right
        behind it without waiting (each engine runs its calls in order: one round trip fewer; the
        probe's answer is read only if `finish` succeeded). Returns both lists of pending calls."""
        calls = [ep.call("finish", sync_id, manifest, version) for ep in self.endpoints]
        probes = [ep.call("probe", self.probe_ids) for ep in self.endpoints] if self.cfg.verify else None
        return calls, probes

    def _stream(self, pipeline: _Pipeline | None, stats: dict) -> str | None:
        """Produce this stage's units (collective) and pack them; the first send error, if any."""
        error = None
        units = iter_units(self.model.chunks, self.model.arch, self.role, impl=self.impl)
        while True:
            t0 = time.perf_counter()
            unit = next(units, None)
            stats["produce_s"] += time.perf_counter() - t0
            if unit is None:
                return error
            if pipeline is not None and error is None:
                try:
                    if self.quantizer is not None:  # ModelOpt's quantization (sync/quantize_s)
                        t0 = time.perf_counter()
                        unit = self.quantizer.quantize_unit(unit)
                        stats["quantize_s"] += time.perf_counter() - t0
                    pipeline.add(unit)
                except SyncError as e:
                    error = str(e)  # keep producing: the TP peers are still in the gathers

    # ------------------------------------------------------------------------------- verify
    def probe(self) -> dict:
        """Collective: compare engine and actor log-probs of the probe ids now (no sync); raises on a mismatch."""
        calls = None
        if self.role.is_leader:  # the engines score while the actor runs its forward
            calls = [ep.call("probe", self.probe_ids) for ep in self.endpoints]
        actor = self._actor_probe()
        engine = self._engine_probe(calls) if self.role.is_leader else {}
        states = self._agree({"error": None, **actor, **engine})
        _raise_first([s["error"] for s in states])
        return self._probe_metrics(states)

    def _actor_probe(self, one_thread: bool = False) -> dict:
        """Collective: the actor's log-probs of the probe ids (on the rank that holds them), and the time.

        `one_thread`: on CPU while the engines load, this tiny forward keeps to one core (with the
        rank's usual threads it competed with the engine's and took twice as long)."""
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        if one_thread:
            torch.set_num_threads(1)
        # One micro-batch for all the probe rows (rows are padded to the longest): a second
        # micro-batch doubled the cost of this forward, which is Python overhead at these sizes.
        rows = len(self.probe_ids) * max(map(len, self.probe_ids))
        quantized = contextlib.nullcontext()
        if getattr(self.model, "probe_format", None) is not None:  # quantized engines (quant/qat.py)
            from megatron_agent.quant.qat import quantized_forward

            quantized = quantized_forward(self.model.chunks)
        try:
            with quantized:
                actor = self.model.logprobs(self.probe_ids, max_tokens=rows)
        finally:
            torch.set_num_threads(threads)
        out: dict = {"actor_probe_s": time.perf_counter() - t0}
        if self.role.holds_probe:
            out["actor"] = [x.float().tolist() for x in actor]
        return out

    def _engine_probe(self, calls: list | None = None) -> dict:
        """Leader: every engine's log-probs of the probe ids (from `calls` already sent, or sent now)."""
        t0 = time.perf_counter()
        out: dict = {"tol": self.tol}  # an FP8 engine's tolerance is known to the senders only
        try:
            if calls is None:
                calls = [ep.call("probe", self.probe_ids) for ep in self.endpoints]
            out["engine"] = [c.result(self.cfg.timeout_s) for c in calls]
        except SyncError as e:
            out["error"] = str(e)
        out["engine_probe_s"] = time.perf_counter() - t0
        return out

    def _probe_metrics(self, states: list[dict]) -> dict:
        engines = next(s["engine"] for s in states if "engine" in s)
        actor = next(s["actor"] for s in states if "actor" in s)
        tol = next((s["tol"] for s in states if "tol" in s), self.tol)
        worst = 0.0
        for e, engine in enumerate(engines):
            value, message = compare_probe(engine, actor, tol)
            if message is not None:
                raise SyncError(
                    f"weight sync probe failed on engine {e}: {message}; the engine does not compute with "
                    "the actor's current weights (a skipped or partial sync, a stale stage, or a bad load)"
                )
            worst = max(worst, value)
        # Conservative: the actor's forward counts in full, though it overlaps the engines' loading.
        probe_s = max(s.get("actor_probe_s", 0.0) for s in states) + max(
            s.get("engine_probe_s", 0.0) for s in states
        )
        return {
            "sync/verified": 1.0,
            "sync/probe_max_abs": worst,
            "sync/probe_s": probe_s,
            "sync/actor_probe_s": max(s.get("actor_probe_s", 0.0) for s in states),
            "sync/engine_probe_s": max(s.get("engine_probe_s", 0.0) for s in states),
        }

    # ------------------------------------------------------------------------------- helpers
    def _metrics(self, states: list[dict], states2: list[dict]) -> dict:
        t_start, t_sent, t_finished, t_end = next(s["times"] for s in states2 if "times" in s)
        stats = [s["stats"] for s in states]
        total = {k: sum(s[k] for s in stats) for k in ("bytes", "num_buckets")}
        slowest = {k: max(s[k] for s in stats) for k in stats[0] if k not in total}
        seconds = t_end - t_start
        metrics = {
            "sync/seconds": seconds,
            "sync/bytes": float(total["bytes"]),
            "sync/gbps": total["bytes"] / max(t_finished - t_start, 1e-9) / 1e9,
            "sync/num_buckets": float(total["num_buckets"]),
            "sync/num_engines": float(len(self.endpoints)),
            "sync/send_s": t_sent - t_start,
            "sync/finish_s": t_finished - t_sent,
            "sync/weight_version": float(next(s["version"] for s in states2 if s.get("version") is not None)),
            "sync/verified": 0.0,
            "sync/probe_max_abs": float("nan"),
            **{f"sync/{k}": v for k, v in slowest.items()},
        }
        if self.cfg.verify:
            metrics.update(self._probe_metrics(states2))
        return metrics

    def _agree(self, obj: dict) -> list[dict]:
        """Every rank's `obj` from data-parallel replica 0, on every rank (Megatron's groups)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        mp_group = ps.get_model_parallel_group()
        gathered: list = [None] * dist.get_world_size(mp_group)
        dist.all_gather_object(gathered, obj, group=mp_group)
        if ps.get_data_parallel_world_size() > 1:
            box = [gathered]
            dist.broadcast_object_list(
                box, src=ps.get_data_parallel_src_rank(), group=ps.get_data_parallel_group()
            )
            gathered = box[0]
        return gathered


def _raise_first(errors: list[str | None]) -> None:
    first = next((e for e in errors if e), None)
    if first is not None:
        raise SyncError(first)
