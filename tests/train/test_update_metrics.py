"""The update's metric reductions: one table for the optimizer steps of a rank and the replicas."""

import pytest

from megatron_agent.train.update_metrics import accumulate, combine_replicas


def test_two_replicas_two_optimizer_steps_reduce_by_the_table():
    ranks = []
    for share in (0.25, 0.75):  # each replica's share of the loss and of the tokens
        totals: dict[str, float] = {}
        for step in range(2):
            accumulate(
                totals,
                {
                    "actor/pg_loss": share * (step + 1),
                    "actor/grad_norm": 3.0 + step,  # global: the same on every replica
                    "actor/pg_clipfrac": 0.5 * 10 * share,  # fraction * local tokens
                    "n_tokens": 10 * share,
                    "n_optimizer_steps": 1.0,
                    "guard/skipped": float(step == 1),
                    "guard/skipped_steps": 4.0 + step,  # a running total: the latest counts
                },
            )
        totals["actor/lr"] = 1e-5
        ranks.append(totals)
    m = combine_replicas(ranks)
    assert m["actor/pg_loss"] == pytest.approx((1 + 2) / 2)  # summed over replicas, mean over steps
    assert m["actor/grad_norm"] == pytest.approx((3 + 4) / 2)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)  # token-weighted
    assert m["guard/skipped"] == 1.0 and m["guard/skipped_steps"] == 5.0 and m["actor/lr"] == 1e-5
    assert "n_tokens" not in m and "n_optimizer_steps" not in m


def test_a_metric_without_a_rule_is_named():
    with pytest.raises(KeyError, match="actor/new_thing"):
        accumulate({}, {"actor/new_thing": 1.0})
