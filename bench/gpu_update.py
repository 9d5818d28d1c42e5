"""Benchmark: the actor update of a ~1B dense model in BF16 on one GPU (tokens/s and MFU).

What is timed: `MegatronModel.train_step`, i.e. forward and backward of every micro-batch over
Megatron's pipeline schedule (through the repo's fused vocab-parallel log-prob head), the fp32
gradient reduction of Megatron's DDP and one step of Megatron's distributed optimizer (fp32
master weights, Adam). The loss is the mean negative log-prob of random token ids (an SFT-shaped
loss; the RL losses cost the same matmuls).

Model (default): Llama-3.2-1B-shaped, hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN 8192,
vocabulary 128,256, tied embeddings (1.24B parameters); sequences of 2048 tokens, 8 micro-batches
of one sequence per step (16k tokens). `--tiny` is a 2-layer, hidden-64 model for a CPU smoke run.

MFU = model FLOPs per second / the GPU's peak dense BF16 rate, with
    model FLOPs per token = 6 * N + 6 * num_layers * seq_len * num_heads * head_dim
where N counts the matmul weights a token passes through (every transformer layer and the
output layer; embedding lookups are free) and the second term is causal attention (QK^T and
AV, forward and backward, half of the S x S square). Activation recomputation is not counted
(it is off here). Peak rates by device name: H100/H200 SXM 989 TFLOP/s, A100 312, and a few
more in `PEAK_TFLOPS`; for any other device pass `--peak-tflops`.

Each spec (Megatron's local spec, and Transformer Engine's where TE and a GPU are present) runs
`--warmup` untimed steps and `--steps` timed ones; the median step is reported. One line per
spec, then the last line `mfu=X tokens_per_s=Y` of the fastest spec (TE where it ran).

Run: .venv/bin/python bench/gpu_update.py [--seq-len 2048 --micro-batches 8 --spec both]
     .venv/bin/python bench/gpu_update.py --tiny --peak-tflops 1   (CPU smoke run)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name fragment, dense BF16 TFLOP/s without sparsity), most specific first.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)


def peak_tflops(device_name: str, override: float | None) -> float:
    """Peak dense BF16 TFLOP/s of `device_name` (or `override`); ValueError naming --peak-tflops."""
    if override:
        return float(override)
    for fragment, value in PEAK_TFLOPS:
        if fragment in device_name:
            return value
    raise ValueError(
        f"no peak BF16 rate known for {device_name!r}: pass --peak-tflops (dense BF16 TFLOP/s of this device)"
    )


def model_arch(tiny: bool):
    """The benchmark's architecture (Llama-3.2-1B-shaped, or a tiny one)."""
    from megatron_agent.models.hf_config import ModelArch

    if tiny:
        return ModelArch("llama", "LlamaForCausalLM", 2, 64, 128, 4, 2, 16, 512, 4096, 1e-5, 10000.0)
    return ModelArch(
        "llama",
        "LlamaForCausalLM",
        16,
        2048,
        8192,
        32,
        8,
        64,
        128256,
        8192,
        1e-5,
        500000.0,
        tied_embeddings=True,
    )


def matmul_params(arch) -> int:
    """Weights of the matmuls one token passes through: every layer's linears and the output layer."""
    q = arch.hidden_size * arch.num_attention_heads * arch.head_dim
    kv = 2 * arch.hidden_size * arch.num_query_groups * arch.head_dim
    o = arch.num_attention_heads * arch.head_dim * arch.hidden_size
    mlp = 3 * arch.hidden_size * arch.ffn_hidden_size
    return arch.num_layers * (q + kv + o + mlp) + arch.hidden_size * arch.vocab_size


def flops_per_token(arch, seq_len: int) -> float:
    """Training FLOPs per token: 6 N plus causal attention (see the module docstring)."""
    attention = 6 * arch.num_layers * seq_len * arch.num_attention_heads * arch.head_dim
    return 6.0 * matmul_params(arch) + attention


def run_spec(impl: str, arch, args) -> dict:
    """Build the actor with `impl`'s layer spec, train `warmup + steps` steps; timings of the timed ones."""
    import torch

    from megatron_agent.models.build import BuildOptions, build_model_chunks
    from megatron_agent.models.policy import MegatronModel, OptimConfig

    opts = BuildOptions(dtype=args.dtype, transformer_impl=impl)
    model = MegatronModel(build_model_chunks(arch, opts), arch, opts, trainable=True)
    model.wrap_for_training(OptimConfig(lr=1e-5, use_distributed_optimizer=True))
    g = torch.Generator().manual_seed(0)
    sequences = [
        torch.randint(0, arch.vocab_size, (args.seq_len,), generator=g).tolist()
        for _ in range(args.micro_batches)
    ]
    num_targets = sum(len(s) - 1 for s in sequences)

    def loss_fn(mb, logp_BT, _entropy):
        return -torch.where(mb.valid_BT, logp_BT, torch.zeros_like(logp_BT)).sum() / num_targets, {}

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outputs, info = model.train_step(sequences, loss_fn, max_tokens=args.seq_len)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(sum(float(o["loss"]) for o in outputs)))
        if not info["update_successful"]:
            raise RuntimeError(f"optimizer step {step} was skipped (non-finite gradients?)")
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {
        "step_s": statistics.median(times),
        "tokens": args.seq_len * args.micro_batches,
        "losses": losses,
        "peak_gib": peak_gib,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer hidden-64 model (CPU smoke run)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048; tiny: 64)")
    parser.add_argument("--micro-batches", type=int, default=None, help="sequences per step (8; tiny: 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument(
        "--spec", default="both", choices=["both", "local", "te"], help="both: local, and TE where present"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="peak dense BF16 TFLOP/s (unknown devices)"
    )
    args = parser.parse_args(argv)
    args.seq_len = args.seq_len or (64 if args.tiny else 2048)
    args.micro_batches = args.micro_batches or (2 if args.tiny else 8)

    import torch

    from megatron_agent.models.build import te_available
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = peak_tflops(device_name, args.peak_tflops)
    specs = {"both": ["local", "te"] if te_available() else ["local"], "local": ["local"], "te": ["te"]}[
        args.spec
    ]
    arch = model_arch(args.tiny)
    fpt = flops_per_token(arch, args.seq_len)
    print(
        f"device={device_name} peak_tflops={peak:g} dtype={args.dtype} params_matmul={matmul_params(arch) / 1e9:.3f}B "
        f"seq_len={args.seq_len} micro_batches={args.micro_batches} flops_per_token={fpt:.4g} specs={','.join(specs)}"
        + ("" if te_available() else " (Transformer Engine absent: local spec only)"),
        flush=True,
    )
    init_model_parallel(1, 1)
    results = {}
    try:
        for impl in specs:
            r = run_spec(impl, arch, args)
            tps = r["tokens"] / r["step_s"]
            r["tokens_per_s"], r["mfu"] = tps, tps * fpt / (peak * 1e12)
            results[impl] = r
            print(
                f"spec={impl} step_s={r['step_s']:.4f} tokens_per_s={tps:.1f} mfu={r['mfu']:.4f} "
                f"peak_mem_gib={r['peak_gib']:.1f} loss_first={r['losses'][0]:.4f} loss_last={r['losses'][-1]:.4f}",
                flush=True,
            )
    finally:
        destroy_model_parallel()
    best = results.get("te") or results["local"]
    print(f"mfu={best['mfu']:.4f} tokens_per_s={best['tokens_per_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
