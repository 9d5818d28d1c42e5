"""Benchmark: fused vocab-parallel log-prob + entropy head against the naive full-vocabulary path.

Setting (defaults): Qwen-sized vocabulary 151,936, 4,096 tokens, hidden 1,024, TP=1, bf16 hidden
states and output weight (how RL trainers run the head; on CPUs with AVX512-BF16 bf16 matmuls
are also the fast ones), fp32 log-prob/entropy math in both variants.

Both variants compute, forward and backward,
    loss = sum_t adv_t * logp_t + 0.01 * sum_t entropy_t
and backpropagate to the hidden states and the output weight:
- naive: logits = hidden @ W.T (bf16, [T, V]), fp32 log_softmax over the full vocabulary, gather
  the target, entropy = -sum p log p, autograd;
- ours: `megatron_agent.models.logprobs.fused_head_logprobs` (never holds [T, V] logits).

Method. Each measurement runs in its own fresh subprocess (so neither variant inherits the other's
allocator state). The subprocess allocates the inputs, then resets the kernel's peak-RSS counter
(writing 5 to /proc/self/clear_refs) and takes the current RSS as the baseline; after the runs,
peak memory is VmHWM (peak RSS from /proc/self/status) minus that baseline, i.e. everything the
forward and backward allocate and touch, gradients included. Each subprocess times one
forward+backward (wall clock; process CPU time is printed too; `--warmup` adds an untimed run
first, which changes little: oneDNN builds its kernels in milliseconds). The variants
alternate, naive / ours, for `--rounds` rounds, so that load from other processes on a shared
machine hits both alike; the best time and the largest peak of each variant are kept. The last
line is `memory_ratio=X time_ratio=Y` (ours / naive).

Run: .venv/bin/python bench/logprobs.py [--tokens 4096 --vocab 151936 --hidden 1024 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ENTROPY_WEIGHT = 0.01


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _worker(args: argparse.Namespace) -> dict:
    import torch

    from megatron_agent.models.logprobs import fused_head_logprobs

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    hidden_TH = torch.randn(args.tokens, args.hidden, generator=gen, dtype=dtype).requires_grad_()
    weight_VH = (torch.randn(args.vocab, args.hidden, generator=gen, dtype=dtype) * 0.02).requires_grad_()
    target_T = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    adv_T = torch.randn(args.tokens, generator=gen)

    def naive():
        logits_TV = hidden_TH @ weight_VH.t()
        logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
        logp_T = logp_TV.gather(1, target_T.unsqueeze(1)).squeeze(1)
        ent_T = -(logp_TV.exp() * logp_TV).sum(-1)
        return logp_T, ent_T

    def ours():
        return fused_head_logprobs(hidden_TH, weight_VH, target_T, chunk_tokens=args.chunk_tokens)

    step = {"naive": naive, "ours": ours}[args.worker]

    def run() -> tuple[float, float]:
        hidden_TH.grad = weight_VH.grad = None
        start = time.perf_counter()
        logp_T, ent_T = step()
        loss = (adv_T * logp_T).sum() + ENTROPY_WEIGHT * ent_T.sum()
        loss.backward()
        return time.perf_counter() - start, loss.item()

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter to the current RSS
    baseline_kib = _rss_kib("VmRSS")
    if args.warmup:
        run()
    cpu_start = time.process_time()
    seconds, loss = run()
    cpu_seconds = time.process_time() - cpu_start
    peak_kib = _rss_kib("VmHWM") - baseline_kib
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "peak_mib": peak_kib / 1024,
        "loss": loss,
        "grad_hidden_norm": hidden_TH.grad.float().norm().item(),
        "grad_weight_norm": weight_VH.grad.float().norm().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="fused_head_logprobs chunk_tokens")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating naive/ours rounds (best time kept)"
    )
    parser.add_argument("--warmup", action="store_true", help="one untimed run first in each subprocess")
    parser.add_argument("--worker", choices=["naive", "ours"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return

    print(
        f"T={args.tokens} V={args.vocab} H={args.hidden} dtype={args.dtype} TP=1 "
        f"chunk_tokens={args.chunk_tokens} threads={torch_threads()} load={os.getloadavg()[0]:.1f} "
        "(forward + backward to hidden and weight)",
        flush=True,
    )
    runs = {"naive": [], "ours": []}
    for _ in range(args.rounds):
        for variant in runs:
            cmd = [sys.executable, __file__, "--worker", variant] + sys.argv[1:]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            runs[variant].append(res)
            print(
                f"{variant:>5}: time {res['seconds']:.2f} s (cpu {res['cpu_seconds']:.2f} s)"
                f"  peak memory {res['peak_mib']:.0f} MiB  loss {res['loss']:.6g}"
                f"  |grad_hidden| {res['grad_hidden_norm']:.6g}  |grad_weight| {res['grad_weight_norm']:.6g}",
                flush=True,
            )
    best = {v: min(r["seconds"] for r in rs) for v, rs in runs.items()}
    peak = {v: max(r["peak_mib"] for r in rs) for v, rs in runs.items()}
    for v in runs:
        print(f"{v:>5}: best time {best[v]:.2f} s, peak memory {peak[v]:.0f} MiB")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    cpu = {v: min(r["cpu_seconds"] for r in rs) for v, rs in runs.items()}
    print(f"cpu_time_ratio={cpu['ours'] / cpu['naive']:.3f} (best process CPU time, ours / naive)")
    memory_ratio = peak["ours"] / peak["naive"]
    time_ratio = best["ours"] / best["naive"]
    print(f"memory_ratio={memory_ratio:.3f} time_ratio={time_ratio:.3f}")


if __name__ == "__main__":
    main()
