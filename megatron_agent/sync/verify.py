"""The probe: fixed token ids scored by the engine and by the actor must agree after every sync.

A checksum proves the bytes arrived; the probe proves the engine *computes* with the actor's
current weights (nothing skipped, no stale pipeline stage, no old prefix-cache KV, no NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Two short sequences: any weight of any layer changes every scored position after the first,
# so a skipped or partial sync shows at once; the actor's forward of the probe is a fixed cost of
# every sync (about 0.13 s at TP=2 over gloo for the 100M benchmark model, four sequences of
# 56 tokens cost twice that).
PROBE_LENGTHS = (8, 5)


def probe_sequences(vocab_size: int, seed: int = 2024) -> list[list[int]]:
    """Fixed token-id sequences (ids below `vocab_size`), the same on every rank and every sync."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROBE_LENGTHS]


def probe_tolerance(dtype: torch.dtype, tol_fp32: float, tol_bf16: float) -> float:
    """Largest |engine - actor| log-prob allowed for a rollout dtype."""
    return tol_fp32 if dtype == torch.float32 else tol_bf16


def compare_probe(
    engine: Sequence[Sequence[float]], actor: Sequence[Sequence[float]], tol: float
) -> tuple[float, str | None]:
    """(max |engine - actor|, None) when every position agrees within `tol`, else (max, message).

    The message names the first sequence and position that differ, with both values. A NaN on
    either side is a difference.
    """
    worst, first = 0.0, None
    for s, (e_row, a_row) in enumerate(zip(engine, actor, strict=True)):
        e = torch.tensor(e_row, dtype=torch.float64)
        a = torch.tensor(a_row, dtype=torch.float64)
        if e.shape != a.shape:
            return float("inf"), f"probe sequence {s}: engine gave {e.numel()} log-probs, actor {a.numel()}"
        diff = (e - a).abs()
        bad = ~(diff <= tol)
        finite = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
        worst = max(worst, float(finite.max()) if finite.numel() else 0.0)
        if bad.any():
            worst = float("inf") if not torch.isfinite(diff).all() else worst
            if first is None:
                p = int(bad.nonzero()[0])
                first = (
                    f"probe sequence {s} position {p + 1}: engine log-prob {float(e[p]):.6f}, "
                    f"actor {float(a[p]):.6f} (|diff| {float(diff[p]):.3g} > tolerance {tol:g})"
                )
    return worst, first
