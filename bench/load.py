"""Benchmark: HF folder -> live Megatron model with weights, at TP1 and TP2, against a plain read.

    python bench/load.py [--work DIR] [--keep] [--repeats 3] [--no-old]

The checkpoint is bench/convert.py's generated Qwen2.5-0.5B-shaped bf16 model (494M parameters,
one 988 MB safetensors file, random weights). Each measurement runs in fresh processes, after
the file was read once (a warm page cache, the same for every phase):
  read    a plain safetensors read of every tensor into the process's memory (load_file, then
          each tensor copied out of the memory map), one process: the bound
  tp1     `policy_from_hf(..., BuildOptions(tp=1, dtype="bf16"), trainable=False)`
  tp2     the same at tp=2 on two gloo ranks (time until both ranks hold their shards)
  old     (once, for reference; --no-old skips it) tp1 the old way: random initialisation, then
          the load
Every process runs with --threads torch threads (default 1). Phases alternate and repeat; the
fastest run of each counts, with the highest peak RSS seen. Printed per phase: wall seconds (of
the slowest rank) and, per rank, CPU seconds (user + system, the least of the runs: a
cross-check on a shared machine), peak RSS above the RSS just before the work (after imports
and process-group setup: the baseline) and the bytes of the rank's own shard. The last line is
`load_ratio=X memory_ratio=Y`: read time / our time and the worst rank's working peak RSS / its
shard bytes, each for the worse of TP1 and TP2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) * 1024


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS


def _plain_read(hf: Path) -> dict:
    from safetensors.torch import load_file

    base = _status("VmRSS")
    _reset_peak()
    start, cpu = time.perf_counter(), _cpu()
    kept, num_bytes = [], 0
    for path in sorted(hf.glob("*.safetensors")):
        for tensor in load_file(path).values():  # views of the memory map: copy them out
            kept.append(tensor.clone())
            num_bytes += tensor.nbytes
    seconds, cpu = time.perf_counter() - start, _cpu() - cpu
    peak = _status("VmHWM")
    return {"seconds": seconds, "ranks": [{"cpu": cpu, "peak": peak, "base": base, "shard": num_bytes}]}


def _model_rank(hf: Path, tp: int, old: bool) -> dict | None:
    """One rank of a TP group (environment from the parent): build and load, report on rank 0."""
    import torch.distributed as dist

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions, build_model_chunks, resolve_transformer_impl
    from megatron_agent.models.hf_config import arch_from_hf_config, load_hf_config
    from megatron_agent.platform.parallel import init_model_parallel
    from megatron_agent.weights.load import load_hf_weights

    init_model_parallel(tp, 1)
    opts = BuildOptions(tp=tp, dtype="bf16")
    dist.barrier()
    base = _status("VmRSS")
    _reset_peak()
    start, cpu = time.perf_counter(), _cpu()
    if old:
        arch = arch_from_hf_config(load_hf_config(hf))
        chunks = build_model_chunks(arch, opts, trainable=False, initialize=True)
        load_hf_weights(chunks, arch, hf, impl=resolve_transformer_impl(opts.transformer_impl))
    else:
        chunks = policy_from_hf(hf, opts, trainable=False).chunks
    mine, cpu = time.perf_counter() - start, _cpu() - cpu
    peak = _status("VmHWM")
    shard = sum(p.nbytes for c in chunks for p in c.parameters())
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"seconds": mine, "cpu": cpu, "peak": peak, "base": base, "shard": shard})
    dist.destroy_process_group()
    if int(os.environ["RANK"]):
        return None
    return {"seconds": max(r["seconds"] for r in rows), "ranks": rows}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(name: str, work: Path, threads: int) -> dict:
    """Run phase `name` in fresh processes (one per rank) and return rank 0's report."""
    with open(work / "hf" / "model.safetensors", "rb") as fh:  # warm page cache for every phase
        while fh.read(64 << 20):
            pass
    world = 2 if name == "tp2" else 1
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
        )
        cmd = [sys.executable, __file__, "--phase", name, "--work", str(work)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"phase {name} failed:\n{err[-4000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _line(name: str, r: dict) -> str:
    ranks = "; ".join(
        f"rank {i}: cpu {x['cpu']:.2f} s, peak {x['peak'] / GIB:.2f} GiB, working {(x['peak'] - x['base']) / GIB:.3f} GiB "
        f"= {(x['peak'] - x['base']) / x['shard']:.2f} x its {x['shard'] / GIB:.3f} GiB"
        for i, x in enumerate(r["ranks"])
    )
    return f"{name:>4}: {r['seconds']:6.2f} s  ({ranks})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--repeats", type=int, default=3, help="runs of each phase (the fastest counts)")
    p.add_argument("--no-old", action="store_true", help="skip the old build's reference run")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process, the same for every phase (on a shared 2-core machine a "
        "second thread only spins: it tripled the CPU time of both the read and the load)",
    )
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        import warnings

        warnings.filterwarnings("ignore")
        hf = Path(args.work) / "hf"
        tp = {"tp1": 1, "tp2": 2, "old": 1}.get(args.phase)
        result = _plain_read(hf) if args.phase == "read" else _model_rank(hf, tp, args.phase == "old")
        if result is not None:
            print(json.dumps(result))
        return

    from bench.convert import generate

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_load_"))
    try:
        if not (work / "hf" / "model.safetensors").is_file():
            size = generate(work / "hf")
            print(f"generated {size / 1e9:.3f} GB bf16 checkpoint (qwen2.5-0.5b shape)")
        print(f"load average before the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        best: dict[str, dict] = {}
        runs: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for name in ("read", "tp1", "tp2"):
                r = _run(name, work, args.threads)
                runs.setdefault(name, []).append(r["seconds"])
                prev = best.get(name)
                if prev is not None:
                    for x, y in zip(r["ranks"], prev["ranks"]):
                        x["peak"] = max(x["peak"] - x["base"], y["peak"] - y["base"]) + x["base"]
                        x["cpu"] = min(x["cpu"], y["cpu"])
                    if prev["seconds"] < r["seconds"]:
                        r["seconds"] = prev["seconds"]
                best[name] = r
        if not args.no_old:
            best["old"] = _run("old", work, args.threads)
        for name, r in best.items():
            print(_line(name, r))
        print(
            "seconds of every run: "
            + "; ".join(f"{n} {', '.join(f'{x:.2f}' for x in v)}" for n, v in runs.items())
        )
        print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        read = best["read"]["seconds"]
        load_ratio = min(read / best[n]["seconds"] for n in ("tp1", "tp2"))
        memory_ratio = max(
            (x["peak"] - x["base"]) / x["shard"] for n in ("tp1", "tp2") for x in best[n]["ranks"]
        )
        print(f"load_ratio={load_ratio:.2f} memory_ratio={memory_ratio:.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
