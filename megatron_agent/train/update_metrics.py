"""How the update's metrics combine: one table, used by the update (over its optimizer steps)
and by the driver (over the data-parallel replicas that report).

Each reporting rank (last pipeline stage, tensor-parallel rank 0 of every data-parallel replica)
returns, per RL step, its metrics combined over the step's optimizer steps; the driver combines
those of the replicas and divides by the step's optimizer-step count or its loss-token count.
A metric missing from the table is an error naming it: a new metric must say how it reduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Reduction:
    """How one metric combines."""

    over_steps: Literal["sum", "last"]
    """Over one rank's optimizer steps: summed, or the last value (running totals)."""
    over_replicas: Literal["sum", "first", "max"]
    """Over the reporting replicas: summed (a local share), the first (equal on every rank), or
    the largest (a wall time: the slowest replica's)."""
    divide_by: Literal["steps", "tokens", None] = None
    """The combined value divided by the optimizer steps, by the loss tokens, or kept."""


SUM_PER_STEP = Reduction("sum", "sum", "steps")
SUM_PER_TOKEN = Reduction("sum", "sum", "tokens")
COUNT = Reduction("sum", "first")
LATEST = Reduction("last", "first")

UPDATE_METRICS: dict[str, Reduction] = {
    "actor/pg_loss": SUM_PER_STEP,  # each step's loss is already a global mean: its sum over replicas
    "actor/kl_loss": SUM_PER_STEP,
    "actor/grad_norm": Reduction("sum", "first", "steps"),  # the global norm, the same on every rank
    "actor/pg_clipfrac": SUM_PER_TOKEN,  # token-weighted: each rank returns fraction * its tokens
    "actor/ppo_kl": SUM_PER_TOKEN,
    "actor/lr": LATEST,  # the learning rate of the next optimizer step
    "n_tokens": Reduction("sum", "sum"),
    "n_optimizer_steps": COUNT,
    "guard/skipped": COUNT,  # optimizer steps skipped in this RL step
    # the critic's update (train/critic_update.py), combined over its own steps and tokens
    "critic/vf_loss": SUM_PER_STEP,
    "critic/vf_clipfrac": SUM_PER_TOKEN,  # tokens where the value clip binds
    "critic/vpred_mean": SUM_PER_TOKEN,
    "critic/grad_norm": Reduction("sum", "first", "steps"),
    "critic/lr": LATEST,
    "critic/guard_skipped": COUNT,
    "timing_s/update_critic": Reduction("last", "max"),  # a separate critic's ranks' own wall time
    # the share of the step's layer passes this rank ran on half its threads (an engine generating)
    "async/rank_threads_low_share": Reduction("last", "max"),
}
PREFIX_RULES: dict[str, Reduction] = {"guard/": LATEST}  # the guard's running totals and maxima
BOOKKEEPING = ("n_tokens", "n_optimizer_steps")  # used for the division, not reported


def reduction(key: str) -> Reduction:
    """The table's entry for `key`; KeyError naming it when it has none."""
    if key in UPDATE_METRICS:
        return UPDATE_METRICS[key]
    for prefix, rule in PREFIX_RULES.items():
        if key.startswith(prefix):
            return rule
    raise KeyError(f"update metric {key!r} has no entry in train/update_metrics.py UPDATE_METRICS")


def accumulate(totals: dict[str, float], step_metrics: dict[str, float]) -> None:
    """Add one optimizer step's metrics into `totals` (one rank)."""
    for key, value in step_metrics.items():
        last = reduction(key).over_steps == "last"
        totals[key] = value if last else totals.get(key, 0.0) + value


def combine_replicas(results: list[dict[str, float]]) -> dict[str, float]:
    """The step's update metrics from the reporting replicas' totals."""
    num_steps = results[0]["n_optimizer_steps"]
    tokens = max(sum(r.get("n_tokens", 0.0) for r in results), 1.0)
    out = {}
    for key in dict.fromkeys(k for r in results for k in r):
        if key in BOOKKEEPING:
            continue
        rule = reduction(key)
        values = [r[key] for r in results if key in r]
        value = {"sum": sum, "max": max, "first": lambda v: v[0]}[rule.over_replicas](values)
        if rule.divide_by == "steps":
            value /= num_steps
        elif rule.divide_by == "tokens":
            value /= tokens
        out[key] = value
    return out
