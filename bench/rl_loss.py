"""Benchmark: policy loss + KL loss + entropy bonus, forward and backward, over 64 x 4,096 tokens.

Compares `megatron_agent.rl` (compute_policy_loss + compute_kl_loss + agg_loss) against a
straightforward eager implementation written below (the usual formula-by-formula code with
autograd over every intermediate; it multiplies by the mask, which is also NaN-unsafe, so the
inputs here are clean). Both compute the same loss and the same metrics (checked before timing).

Time: wall time of both variants in adjacent pairs (alternating which goes first) in this
process after warm-up; time_ratio is the median over pairs of ours / eager, which is robust to the
load of a shared machine. Medians and minima of each are printed too.
Memory, two measures, each variant in a fresh subprocess:
  saved   bytes of the distinct tensors autograd keeps for the backward pass (exact, via
          torch.autograd.graph.saved_tensors_hooks);
  rss     peak resident set size (VmHWM, reset through /proc/self/clear_refs) minus the
          resident size right before three forward+backward passes on inputs already built
          (includes transient temporaries and allocator behaviour, so it is approximate).
The last line is `time_ratio=X` (ours / eager; below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_agent.rl import agg_loss, compute_kl_loss, compute_policy_loss, global_batch_counts  # noqa: E402

B, T = 64, 4096
KL_COEF, ENT_COEF = 0.1, 0.01


def make_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random but realistic inputs: ~75% loss tokens, log-ratios around 0, some far off."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4
    lengths = torch.randint(T // 2, T + 1, (B, 1), generator=g)
    return {
        "logp": old + torch.randn(B, T, generator=g) * 0.3,
        "old": old,
        "ref": old + torch.randn(B, T, generator=g) * 0.3,
        "adv": torch.randn(B, T, generator=g),
        "mask": torch.arange(T)[None] < lengths,
        "entropy": torch.rand(B, T, generator=g) * 3,
    }


def eager_step(logp, old, ref, adv, mask, entropy):
    """The straightforward implementation: dual-clip PPO + k3+ KL + entropy, token-mean."""
    mask_f = mask.float()
    num = mask_f.sum()

    def masked_mean(x):
        return (x * mask_f).sum() / num

    neg_approx_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_approx_kl)
    ppo_kl = masked_mean(-neg_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 0.8, 1.2)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float())
    pg_losses3 = -adv * 3.0
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (adv < 0).float())
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = masked_mean(pg_losses)

    kl = torch.clamp(ref - logp, -20.0, 20.0)
    k3 = torch.clamp(torch.exp(kl) - kl - 1, -10.0, 10.0)
    k2 = 0.5 * (logp - ref).square()
    kl_loss = masked_mean(k2 + (k3 - k2).detach())
    entropy_loss = masked_mean(entropy)

    loss = pg_loss + KL_COEF * kl_loss - ENT_COEF * entropy_loss
    loss.backward()
    return loss.detach(), {
        "pg_clipfrac": pg_clipfrac,
        "pg_clipfrac_lower": pg_clipfrac_lower,
        "ppo_kl": ppo_kl,
    }


def ours_step(logp, old, ref, adv, mask, entropy):
    """The same loss with megatron_agent.rl."""
    counts = global_batch_counts(mask)  # once per mini-batch (all-reduced when distributed)
    n = {"num_tokens": counts.num_tokens, "num_seqs": counts.num_seqs}
    pg_loss, metrics = compute_policy_loss(logp, old, adv, mask, **n)
    kl_loss, _ = compute_kl_loss(logp, ref, mask, estimator="k3+", **n)
    loss = pg_loss + KL_COEF * kl_loss - ENT_COEF * agg_loss(entropy, mask, **n)
    loss.backward()
    return loss.detach(), metrics


VARIANTS = {"eager": eager_step, "ours": ours_step}


def _run(fn, x):
    logp = x["logp"].clone().requires_grad_()
    entropy = x["entropy"].clone().requires_grad_()
    loss, metrics = fn(logp, x["old"], x["ref"], x["adv"], x["mask"], entropy)
    return loss, metrics, logp.grad, entropy.grad


def _status_bytes(key: str) -> int:
    """A size from /proc/self/status (VmRSS: resident now, VmHWM: peak resident)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def measure_memory(name: str) -> dict:
    """Run in a fresh process: bytes saved for backward, and the peak RSS delta."""
    x = make_inputs()
    # Initialise torch's lazy runtime state (thread pool, autograd engine) outside the window.
    small = {k: v[:1, :64].clone() for k, v in x.items()}
    _run(VARIANTS[name], small)
    # Reset the peak-RSS mark to the current RSS (Linux >= 4.0). ru_maxrss is not used: it can
    # carry the parent's peak over fork + exec.
    Path("/proc/self/clear_refs").write_text("5")
    rss_before = _status_bytes("VmRSS")
    saved: dict[int, int] = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run(VARIANTS[name], x)
    for _ in range(2):
        _run(VARIANTS[name], x)
    return {"saved_bytes": sum(saved.values()), "peak_rss_delta_bytes": _status_bytes("VmHWM") - rss_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--memory-only", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_only:
        print(json.dumps(measure_memory(args.memory_only)))
        return

    x = make_inputs()
    ref_out, ours_out = _run(eager_step, x), _run(ours_step, x)
    torch.testing.assert_close(ours_out[0], ref_out[0])
    torch.testing.assert_close(ours_out[2], ref_out[2])
    torch.testing.assert_close(ours_out[3], ref_out[3])
    for key, value in ref_out[1].items():
        torch.testing.assert_close(ours_out[1][key], value)

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(3):
        for fn in VARIANTS.values():
            _run(fn, x)
    for i in range(args.repeats):
        # Adjacent pairs in alternating order: slow drifts of the machine's load hit both alike.
        for name in sorted(VARIANTS, reverse=bool(i % 2)):
            start = time.perf_counter()
            _run(VARIANTS[name], x)
            times[name].append(time.perf_counter() - start)

    memory = {}
    for name in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-only", name, "--threads", str(torch.get_num_threads())],
            check=True,
            capture_output=True,
            text=True,
        )
        memory[name] = json.loads(out.stdout.strip().splitlines()[-1])

    print(
        f"rl_loss: policy loss + k3+ KL + entropy, fwd+bwd, {B} x {T} tokens, fp32, "
        f"{torch.get_num_threads()} threads, {args.repeats} paired repeats"
    )
    for name in VARIANTS:
        med, best = statistics.median(times[name]), min(times[name])
        mem = memory[name]
        print(
            f"  {name:5s} median {med * 1e3:8.2f} ms  min {best * 1e3:8.2f} ms  "
            f"saved-for-backward {mem['saved_bytes'] / 2**20:6.2f} MiB  "
            f"peak RSS delta {mem['peak_rss_delta_bytes'] / 2**20:6.2f} MiB"
        )
    ratio = statistics.median(o / e for o, e in zip(times["ours"], times["eager"]))
    print("time_ratio is the median over repeats of ours / eager within a pair")
    print(f"time_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
