"""Engine side of the weight sync: load buckets in place, check them, finish, answer the probe.

`WeightReceiver(engine).handle(method, *args, **kwargs)` is the one entry point an RPC layer
forwards to (a pipe server, a Ray actor method, or a direct call). Methods:

- `info()`: pid, host, device, weight_version, number of engine workers.
- `load_bucket(header, payload)`: open the bucket (zero-copy), recompute every tensor's checksum,
  and load the tensors in place. In a vLLM engine this runs inside each worker
  (`collective_rpc`), so a TP engine shards the full HF tensors itself; an unquantized TP1 engine
  on CPU is loaded in one pass by `cpu_loader.DirectLoader`, any other with vLLM's `reload_weights`.
- `finish(sync_id, manifest, version=None)`: check that every bucket the senders sent arrived,
  then reset the prefix cache once and set `weight_version` to `version` (default: one more).
- `probe(sequences)`: prompt log-probs of fixed token ids (log p(token i | tokens < i)).

With `in_flight=True` (asynchronous RL) a sync may find generation requests in flight: its
caller guarantees that the engine takes no step from the first bucket to `finish`, which then
makes the requests recompute their KV under the new weights (`VLLMEngine.weights_changed`).
- `init_nccl(...)`: join an NCCL group with a sender (GPU, disaggregated).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence

from megatron_agent.rollout.engine import refresh_tied_lm_head
from megatron_agent.sync.buckets import BucketHeader, SyncError, first_bad_entry, iter_views
from megatron_agent.sync.cpu_loader import DirectLoader
from megatron_agent.sync.transports import host_id, open_bucket, release_buckets

# vLLM logs a warning for every module a partial reload does not touch; a bucket is partial.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


@contextlib.contextmanager
def _quiet_partial_reload():
    loggers = [logging.getLogger(n) for n in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


TIED_EMBEDDING = "model.embed_tokens.weight"


def load_bucket_on_worker(worker, header: BucketHeader, payload: dict, verify: bool) -> dict:
    """Run inside a vLLM worker (or with worker=None for a non-vLLM engine): check and load one bucket.

    Returns {"bad": (name, expected, got)} on a checksum mismatch (nothing loaded), else timings.
    """
    from megatron_agent.sync.nccl import worker_group

    u8 = open_bucket(payload, nccl_group=worker_group(worker))
    t0 = time.perf_counter()
    if verify and header.algo:
        bad = first_bad_entry(u8, header)
        if bad is not None:
            entry, got = bad
            return {"bad": (entry.name, entry.checksum, got)}
    t1 = time.perf_counter()
    if worker is not None:
        model = worker.model_runner.get_model()
        loader = _direct_loader(worker, model)
        if loader is not None:
            loader.load(u8, header)
        else:
            with _quiet_partial_reload():
                worker.reload_weights(weights_iterator=iter_views(u8, header))
        if TIED_EMBEDDING in header.names():
            refresh_tied_lm_head(model)
    return {"checksum_s": t1 - t0, "load_s": time.perf_counter() - t1, "u8": u8 if worker is None else None}


_LOADERS: dict[int, DirectLoader | None] = {}


def _direct_loader(worker, model) -> DirectLoader | None:
    """The worker's one-pass CPU loader, or None where vLLM's reload_weights must do it (cached per model)."""
    if id(model) not in _LOADERS:
        world_size = worker.vllm_config.parallel_config.world_size
        _LOADERS[id(model)] = DirectLoader.for_model(model, world_size)
    return _LOADERS[id(model)]


def release_on_worker(worker) -> None:
    """End of a sync in this worker: close the shared-memory maps of segments that are gone (keep the others)."""
    release_buckets(keep_live=True)


class WeightReceiver:
    """Loads synced weights into a rollout engine (a `VLLMEngine`, or anything with its update API).

    A non-vLLM engine needs `update_weights(named_tensors)`, `weight_version`, and for the probe
    `prompt_logprobs(sequences)`.
    """

    def __init__(self, engine, in_flight: bool = False):
        """`in_flight`: accept a sync while generation requests are in flight (module docstring)."""
        self.engine = engine
        self.in_flight = in_flight
        self._vllm = hasattr(engine, "llm")
        self._sync_id: int | None = None
        self._received: dict[tuple[int, int], list[str]] = {}
        self._version_before = 0

    def handle(self, method: str, *args, **kwargs):
        """Dispatch one remote call (`method` is one of the public methods of this class)."""
        if method not in ("info", "load_bucket", "finish", "probe", "init_nccl", "ping"):
            raise ValueError(f"WeightReceiver has no method {method!r}")
        return getattr(self, method)(*args, **kwargs)

    def ping(self) -> int:
        """Liveness check; returns the pid."""
        return os.getpid()

    def info(self) -> dict:
        """Where the engine lives and what it can receive."""
        on_gpu = bool(getattr(self.engine, "on_gpu", False))
        num_workers = 1
        if self._vllm:
            num_workers = self.engine.llm.llm_engine.vllm_config.parallel_config.world_size
        return {
            "pid": os.getpid(),
            "host": host_id(),
            "device": "cuda" if on_gpu else "cpu",
            "weight_version": int(self.engine.weight_version),
            "num_workers": num_workers,
            "quantization": getattr(self.engine, "quantization", None),
        }

    def _start(self, sync_id: int) -> None:
        self._sync_id = sync_id
        self._received = {}
        self._version_before = int(self.engine.weight_version)
        if getattr(self.engine, "_sleeping", False):
            self.engine.wake_up()  # colocated GPU engines sleep during training: wake before loading
        if self._vllm and not self.in_flight and self.engine.llm.llm_engine.has_unfinished_requests():
            raise SyncError("weight sync started while the engine still has generation requests in flight")

    def load_bucket(self, header: BucketHeader, payload: dict, verify: bool = True) -> dict:
        """Check and load one bucket; raises SyncError naming the first tensor whose checksum differs."""
        if header.sync_id != self._sync_id:
            self._start(header.sync_id)
        if self._vllm:
            results = self.engine.llm.collective_rpc(load_bucket_on_worker, args=(header, payload, verify))
        else:
            results = [load_bucket_on_worker(None, header, payload, verify)]
        for r in results:
            if "bad" in r:
                name, want, got = r["bad"]
                raise SyncError(
                    f"checksum mismatch in sync {header.sync_id}, bucket {header.index} from actor rank "
                    f"{header.sender}: tensor {name} was sent with {header.algo} {want:#x} but arrived as {got:#x} "
                    "(corrupted in transit; check the transport)"
                )
        if not self._vllm:
            u8 = results[0].pop("u8")
            self.engine.update_weights(iter_views(u8, header))
            del u8
        self._received[header.key] = header.names()
        return {
            "bytes": header.payload_bytes,
            "checksum_s": max(r["checksum_s"] for r in results),
            "load_s": max(r["load_s"] for r in results),
        }

    def finish(
        self, sync_id: int, manifest: dict[tuple[int, int], list[str]], version: int | None = None
    ) -> int:
        """End a sync: every bucket in `manifest` must have arrived; reset the prefix cache and label
        the weights `version` (default: the version before the sync plus one)."""
        if self._vllm:
            self.engine.llm.collective_rpc(release_on_worker)
        else:
            release_buckets(keep_live=True)
        received = self._received if self._sync_id == sync_id else {}
        missing = [k for k in sorted(manifest) if k not in received]
        if missing:
            sender, index = missing[0]
            names = manifest[missing[0]]
            raise SyncError(
                f"sync {sync_id}: {len(missing)} of {len(manifest)} buckets never reached the engine; the "
                f"first is bucket {index} from actor rank {sender} with {len(names)} tensors "
                f"({', '.join(names[:4])}{' ...' if len(names) > 4 else ''})"
            )
        version = self._version_before + 1 if version is None else int(version)
        if self._vllm:  # cached KV was computed with the old weights
            self.engine.weights_changed(version)
        else:
            self.engine.weight_version = version
        self._sync_id = None
        self._received = {}
        return int(self.engine.weight_version)

    def probe(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Engine log p(token i | tokens < i) for i >= 1 of each sequence (fp32 values as floats)."""
        if not hasattr(self.engine, "prompt_logprobs"):
            raise SyncError(
                f"{type(self.engine).__name__} has no prompt_logprobs(); set sync.verify=false for it"
            )
        return [list(map(float, x)) for x in self.engine.prompt_logprobs(sequences)]

    def init_nccl(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the NCCL weight-sync group of one sender (each engine worker at rank_offset + its rank)."""
        from megatron_agent.sync.nccl import join_on_worker

        if not self._vllm:
            raise SyncError("NCCL weight sync needs a vLLM engine")
        self.engine.llm.collective_rpc(join_on_worker, args=(host, port, rank_offset, world_size))
