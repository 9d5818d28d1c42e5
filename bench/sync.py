"""Weight-sync benchmark: a full verified sync against a plain shared-memory copy of the same bytes.

    python bench/sync.py [--hidden 768 --layers 8 --vocab 32000] [--rounds 7] [--bucket-mb 256]

A random Qwen2-shaped model of about 100M parameters in fp32; the actor runs at TP=2 over gloo
(two torchrun ranks), the vLLM engine in its own process. Before each round the actor's weights
change (scaled by 1.001), so a sync that moved nothing would fail its probe. Each round times one
full sync (the actor's probe forward, both TP ranks writing their shards into the shared-memory
buckets with the layout mapping, checksums, the engine's in-place load with its checksums,
finish, the engine's probe) and, next to it, the practical limit:
the same number of bytes copied from this process into shared memory and out of it by another
process, in the same bucket size, double-buffered. Last line: `efficiency=X verify_share=Y`
(limit time / sync time; the verification's share of the sync: the time that both checksums and
the probe add to it, from the same sync without verification timed in the same rounds; the sum
of the verification phases, which overlap the engine's loading, is printed above it).
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    import subprocess

    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        model = make_model(Path(tmp) / "model", args)
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
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith(("(", "INFO", "WARNING"))]
        print("\n".join(lines))
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
