"""Weight-sync benchmark: a full verified sync against a plain shared-memory copy of the same bytes.

    python bench/sync.py [--hidden 768 --layers 8 --vocab 32000] [--rounds 7] [--bucket-mb 256]

A random Qwen2-shaped model of about 100M parameters in fp32; the actor runs at TP=2 over gloo
(two torchrun ranks), the vLLM engine in its own process. Before each round the actor's weights
change (scaled by 1.001), so a sync that moved nothing would fail its probe. Each round times one
full sync (the actor's probe forward, both TP ranks writing their shards into the shared-memory
buckets with the layout mapping, checksums, the engine's in-place load with its checksums,
finish, the engine's probe) and, next to it, the practical limit:
the same number of bytes copied from this process into shared memory and out of it by another
process, in the same bucket size, double-buffered.

Then quantized rollout weights (`--quant-rounds`, 0 skips it): a Qwen2.5-0.5B-shaped random model
(hidden 896, 24 layers, FFN 4864, vocabulary 151,936, tied; bf16 rollout dtype) at TP=2 synced,
unverified, into a sink engine process that asks for bf16, real FP8 (per tensor) or real NVFP4
(W4A16) weights and only takes the buckets in (a CPU has no FP8/FP4 kernels to load them into):
bytes sent per sync and sync time per format, ModelOpt's quantization time (`sync/quantize_s`)
as a share of the sync, and the ratio of the quantized linear weights alone (the embedding and
the norms stay bf16). Last line: `efficiency=X verify_share=Y fp8_bytes_ratio=F nvfp4_bytes_ratio=N`
(limit time / sync time; the verification's share of the sync: the time that both checksums and
the probe add to it, from the same sync without verification timed in the same rounds; the sum
of the verification phases, which overlap the engine's loading, is printed above it; bytes per
sync of FP8 and NVFP4 rollout weights over bf16's, whole syncs).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_model(out: Path, args) -> Path:
    """The ~100M-parameter random HF model (written once per run)."""
    from megatron_agent.models.tiny import make_tiny_model

    return make_tiny_model(
        out,
        "qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 64 // 3),
    )


# ---- the limit: a plain double-buffered copy through shared memory to another process ---------


def _limit_child(conn, paths: list[str], bucket: int, total: int) -> None:
    import mmap

    import torch

    torch.set_num_threads(1)
    dest = torch.ones(total, dtype=torch.uint8)  # touched, like an engine's parameters
    views = []
    for p in paths:
        fd = os.open(p, os.O_RDWR)
        views.append(torch.frombuffer(mmap.mmap(fd, bucket, flags=mmap.MAP_SHARED), dtype=torch.uint8))
        os.close(fd)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        slot, offset, n = msg
        dest[offset : offset + n].copy_(views[slot][:n])
        conn.send(slot)


def limit_seconds(total: int, bucket: int) -> float:
    """Seconds to move `total` bytes: copy into one of two shm buffers, the other process copies out."""
    import multiprocessing as mp

    import torch

    from megatron_agent.sync.transports import BucketBuffer

    src = torch.ones(total, dtype=torch.uint8)
    ctx = mp.get_context("spawn")
    buffers = [BucketBuffer(bucket, shared=True, device="cpu") for _ in range(2)]
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_limit_child, args=(child, [b.path for b in buffers], bucket, total))
    proc.start()
    try:
        assert parent.recv() == "ready"
        busy = [False, False]
        t0 = time.perf_counter()
        offset, slot = 0, 0
        while offset < total:
            if busy[slot]:
                busy[parent.recv()] = False
            n = min(bucket, total - offset)
            buffers[slot].u8[:n].copy_(src[offset : offset + n])
            parent.send((slot, offset, n))
            busy[slot] = True
            offset += n
            slot ^= 1
        for _ in range(sum(busy)):
            parent.recv()
        seconds = time.perf_counter() - t0
        parent.send(None)
        proc.join(30)
        return seconds
    finally:
        for b in buffers:
            b.close()


# ---- the actor side (torchrun worker) ---------------------------------------------------------


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.config import SyncConfig
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.platform.parallel import init_model_parallel
    from megatron_agent.sync import SubprocessEndpoint, WeightSender

    init_model_parallel(args.tp, 1)
    rank = dist.get_rank()
    engine = None
    if rank == 0:
        engine = SubprocessEndpoint(
            args.model,
            {"dtype": "float32", "kv_cache_memory_bytes": 128 << 20, "cache_dir": args.cache},
            env={"OMP_NUM_THREADS": "1"},
            name="bench-engine",
        )
    model = policy_from_hf(args.model, BuildOptions(tp=args.tp), trainable=False)
    endpoints = [engine] if rank == 0 else []
    sender = WeightSender(model, SyncConfig(bucket_mb=args.bucket_mb), endpoints)
    # The same sync without verification (no checksums, no probe), timed in the same rounds: the
    # difference is what verification costs, also where it overlaps the transfer.
    unverified = WeightSender(model, SyncConfig(bucket_mb=args.bucket_mb, verify=False), endpoints)
    for s in (sender, unverified):
        s.sync()  # warm-up: first-call costs (engine connection, segment, probe compilation paths)

    def timed_sync(s) -> dict:
        # New weights every time (the same on every TP rank), so a sync that moved nothing would
        # fail its probe instead of passing against the engine's unchanged copy.
        with torch.no_grad():
            for chunk in model.chunks:
                for p in chunk.parameters():
                    p.mul_(1.001)
        dist.barrier()
        m = s.sync()
        dist.barrier()
        return m

    rounds = []
    for _ in range(args.rounds):
        m = timed_sync(sender)
        limit = limit_seconds(int(m["sync/bytes"]), args.bucket_mb << 20) if rank == 0 else 0.0
        rounds.append((m, limit, timed_sync(unverified)["sync/seconds"]))
    sender.sync()  # the engine ends on verified weights
    for s in (sender, unverified):
        s.close()
    if rank == 0:
        report(rounds)
        engine.close()
    dist.barrier()


class QuantizedSink:
    """An engine process that asks for (quantized) weights and only takes the buckets in."""

    def __init__(self, model_path, quantization="", fmt=""):
        self.weight_version = 0
        self.quantization = {"quantization": quantization, "format": fmt} if quantization else None

    def update_weights(self, named_tensors):
        for _ in named_tensors:  # the receiver's views of the bucket, each taken
            pass
        self.weight_version += 1
        return self.weight_version


QUANT_CASES = {"bf16": ("", ""), "fp8": ("fp8", "fp8"), "nvfp4": ("nvfp4_w4a16", "nvfp4")}


def quantized_worker(args) -> None:
    """Bytes and time per sync of bf16, FP8 and NVFP4 rollout weights (the 0.5B-shaped model)."""
    import torch
    import torch.distributed as dist

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.config import SyncConfig
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.platform.parallel import init_model_parallel
    from megatron_agent.quant.formats import is_quantized_linear
    from megatron_agent.sync import SubprocessEndpoint, WeightSender
    from megatron_agent.weights.hf_io import HFCheckpointReader

    init_model_parallel(args.tp, 1)
    rank = dist.get_rank()
    model = policy_from_hf(args.model, BuildOptions(tp=args.tp, dtype="bf16"), trainable=False)
    results = {}
    for case, (quantization, fmt) in QUANT_CASES.items():
        sink = None
        if rank == 0:
            sink = SubprocessEndpoint(
                args.model,
                {"quantization": quantization, "fmt": fmt},
                env={"OMP_NUM_THREADS": "1"},
                name=f"sink-{case}",
                engine_class="bench.sync:QuantizedSink",
            )
        sender = WeightSender(
            model,
            SyncConfig(bucket_mb=args.bucket_mb, verify=False),
            [sink] if rank == 0 else [],
            rollout_dtype=torch.bfloat16,
        )
        sender.sync()  # warm-up
        rounds = [sender.sync() for _ in range(args.quant_rounds)]
        sender.close()
        if sink is not None:
            sink.close()
        results[case] = rounds
    if rank == 0:
        with HFCheckpointReader(args.model) as reader:
            linear = sum(
                math.prod(reader.get_slice(n).get_shape()) for n in reader.names() if is_quantized_linear(n)
            )
        quant_report(results, linear)
    dist.barrier()


QUANT_PHASES = ("sync/produce_s", "sync/quantize_s", "sync/pack_s", "sync/barrier_s", "sync/wait_s")
"""The sender's phases printed under each format (seconds, rank 0)."""


def quant_report(results: dict, num_linear: int) -> None:
    """Per format: bytes, sync seconds, quantization share; the summary ratios (`QUANT_RATIOS ...`)."""
    med = {
        case: {k: statistics.median(m[k] for m in rounds) for k in rounds[0]}
        for case, rounds in results.items()
    }
    bf16 = med["bf16"]["sync/bytes"]
    rest = bf16 - 2 * num_linear  # what every format sends in bf16 (embedding, norms)
    print(
        f"quantized rollout weights (0.5B-shaped, {num_linear / 1e6:.0f}M linear weights of the sync's "
        f"{bf16 / 2e6:.0f}M; medians over {len(results['bf16'])} unverified syncs):"
    )
    for case, m in med.items():
        print(
            f"  {case:<6} {m['sync/bytes'] / 1e9:6.3f} GB  {m['sync/bytes'] / bf16:6.3f} of bf16 "
            f"(linear weights {(m['sync/bytes'] - rest) / (2 * num_linear):5.3f})  sync {m['sync/seconds']:6.2f} s  "
            f"ModelOpt quantization {m['sync/quantize_s']:6.2f} s ({m['sync/quantize_s'] / m['sync/seconds']:.3f} of the sync)"
        )
        print("         " + "  ".join(f"{k.removeprefix('sync/')} {m.get(k, 0.0):.2f}" for k in QUANT_PHASES))
    print(
        f"QUANT_RATIOS fp8_bytes_ratio={med['fp8']['sync/bytes'] / bf16:.3f} "
        f"nvfp4_bytes_ratio={med['nvfp4']['sync/bytes'] / bf16:.3f}"
    )


def report(rounds) -> None:
    """Print each round, then the medians and the summary line."""
    phases = [
        ("gather+map", "sync/produce_s"),
        ("write/pack shards", "sync/pack_s"),
        ("TP barriers", "sync/barrier_s"),
        ("  sender checksum", "sync/checksum_s"),
        ("buffer alloc", "sync/alloc_s"),
        ("wait for engine", "sync/wait_s"),
        ("  engine load", "sync/engine_load_s"),
        ("  engine checksum", "sync/engine_checksum_s"),
        ("finish", "sync/finish_s"),
        ("probe", "sync/probe_s"),
        ("  actor forward", "sync/actor_probe_s"),
        ("  engine scoring", "sync/engine_probe_s"),
        ("full sync", "sync/seconds"),
    ]
    for i, (m, limit, plain) in enumerate(rounds):
        print(
            f"round {i}: sync {m['sync/seconds']:.3f} s, limit {limit:.3f} s, unverified sync {plain:.3f} s, "
            f"{m['sync/num_buckets']:.0f} buckets"
        )
    gb = rounds[0][0]["sync/bytes"] / 1e9
    print(f"bytes per sync: {gb:.3f} GB (fp32), medians over {len(rounds)} rounds:")
    for label, key in phases:
        s = statistics.median(m.get(key, 0.0) for m, _, _ in rounds)
        rate = f"{gb / s:8.2f} GB/s" if s >= 1e-3 else "       -"
        print(f"  {label:<24} {s:8.3f} s  {rate}")
    sync_s = statistics.median(m["sync/seconds"] for m, _, _ in rounds)
    limit_s = statistics.median(limit for _, limit, _ in rounds)
    plain_s = statistics.median(plain for _, _, plain in rounds)
    phases_s = statistics.median(
        m["sync/checksum_s"] + m["sync/engine_checksum_s"] + m["sync/probe_s"] for m, _, _ in rounds
    )
    print(f"  {'limit (shm copy)':<24} {limit_s:8.3f} s  {gb / limit_s:8.2f} GB/s")
    print(f"  {'unverified sync':<24} {plain_s:8.3f} s  {gb / plain_s:8.2f} GB/s")
    print(
        f"verification: adds {sync_s - plain_s:.3f} s to the sync; its phases sum to {phases_s:.3f} s "
        f"({phases_s / sync_s:.3f} of the sync; the actor's probe runs while the engine loads)"
    )
    print(f"efficiency={limit_s / sync_s:.3f} verify_share={(sync_s - plain_s) / sync_s:.3f}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--quant-rounds", type=int, default=3, help="timed syncs per quantized format (0: skip)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quantized", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        quantized_worker(args) if args.quantized else worker(args)
        return
    last = run_worker(args, make_model, quantized=False)
    if args.quant_rounds:
        ratios = run_worker(args, make_quant_model, quantized=True)
        last += " " + ratios.removeprefix("QUANT_RATIOS ")
    print(last)


def make_quant_model(out: Path, args) -> Path:
    """The Qwen2.5-0.5B-shaped random model (bf16) of the quantized cases."""
    import torch

    from megatron_agent.models.tiny import make_tiny_model

    return make_tiny_model(
        out,
        "qwen2",
        tied=True,
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        dtype=torch.bfloat16,
    )


def run_worker(args, make, *, quantized: bool) -> str:
    """Run the torchrun worker on a model made by `make`; print its report; return its last line."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        model = make(Path(tmp) / "model", args)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.tp),
            "--master_port",
            str(_free_port()),
            __file__,
            "--worker",
            "--model",
            str(model),
            "--cache",
            tmp,
            "--tp",
            str(args.tp),
            "--rounds",
            str(args.rounds),
            "--bucket-mb",
            str(args.bucket_mb),
            "--quant-rounds",
            str(args.quant_rounds),
            *(["--quantized"] if quantized else []),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith(("(", "INFO", "WARNING"))]
        if proc.returncode != 0:
            print("\n".join(lines))
            print(proc.stderr[-4000:], file=sys.stderr)
            sys.exit(proc.returncode)
        print("\n".join(lines[:-1]))
        return lines[-1]


if __name__ == "__main__":
    main()
