"""Property tests: masked garbage is invisible, huge gaps stay finite, bf16 equals its fp32 upcast."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_agent.rl import agg_loss, compute_kl_loss, compute_policy_loss
from megatron_agent.rl.aggregate import AGG_MODES
from megatron_agent.rl.kl import KL_ESTIMATORS

SETTINGS = settings(max_examples=50, deadline=None)
POISON = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30, -1e30])


def _inputs(seed, b, t, gap=1.0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 5
    logp = old + (torch.rand(b, t, generator=g) * 2 - 1) * gap
    return {
        "logp": logp,
        "old": old,
        "ref": old + torch.randn(b, t, generator=g) * gap,
        "adv": torch.randn(b, t, generator=g),
        "weights": torch.rand(b, t, generator=g) * 2,
        "entropy": torch.rand(b, t, generator=g),
        "mask": torch.rand(b, t, generator=g) > 0.4,
    }


def _loss_and_grads(x, mode, estimator, loss_mode, dtype=None):
    logp = x["logp"].to(dtype or x["logp"].dtype).requires_grad_()
    ent = x["entropy"].to(dtype or x["entropy"].dtype).requires_grad_()
    cast = (lambda v: v.to(dtype)) if dtype else (lambda v: v)
    pg, _ = compute_policy_loss(
        logp,
        cast(x["old"]),
        cast(x["adv"]),
        x["mask"],
        loss_agg_mode=mode,
        rollout_is_weights=cast(x["weights"]),
        loss_mode=loss_mode,
    )
    kl, _ = compute_kl_loss(logp, cast(x["ref"]), x["mask"], estimator=estimator, loss_agg_mode=mode)
    ent_term = agg_loss(ent, x["mask"], mode)
    loss = pg + 0.1 * kl - 0.01 * ent_term
    # Per-term gradients: autograd would sum the terms' bf16 gradients in bf16 on a bf16 leaf
    # (a second rounding that no loss implementation can avoid; upcast once to avoid it).
    g_pg, g_kl = (torch.autograd.grad(term, logp, retain_graph=True)[0] for term in (pg, kl))
    (g_ent,) = torch.autograd.grad(ent_term, ent)
    return loss.detach(), g_pg, g_kl, g_ent


common = dict(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 4),
    t=st.integers(1, 9),
    mode=st.sampled_from(AGG_MODES),
    estimator=st.sampled_from(KL_ESTIMATORS),
    loss_mode=st.sampled_from(["vanilla", "gspo"]),
)


@SETTINGS
@given(poison=POISON, **common)
def test_garbage_in_masked_positions_is_bitwise_invisible(seed, b, t, mode, estimator, loss_mode, poison):
    clean = _inputs(seed, b, t)
    dirty = {k: v.clone() for k, v in clean.items()}
    masked = ~clean["mask"]
    for key in ("logp", "old", "ref", "adv", "weights", "entropy"):
        dirty[key][masked] = poison
    a = _loss_and_grads(clean, mode, estimator, loss_mode)
    z = _loss_and_grads(dirty, mode, estimator, loss_mode)
    for u, v in zip(a, z):
        assert torch.equal(u, v)
    assert torch.isfinite(a[0])


@SETTINGS
@given(gap=st.floats(1.0, 1e4), sign=st.sampled_from([-1.0, 1.0]), **common)
def test_huge_log_prob_gaps_stay_finite(seed, b, t, mode, estimator, loss_mode, gap, sign):
    x = _inputs(seed, b, t)
    x["logp"] = x["old"] + sign * gap * torch.rand_like(x["old"])
    x["ref"] = x["old"] - sign * gap * torch.rand_like(x["old"])
    loss, *grads = _loss_and_grads(x, mode, estimator, loss_mode)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


@SETTINGS
@given(**common)
def test_bf16_equals_its_fp32_upcast(seed, b, t, mode, estimator, loss_mode):
    x = _inputs(seed, b, t, gap=3.0)
    x16 = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in x.items()}
    up = {k: (v.float() if v.is_floating_point() else v) for k, v in x16.items()}
    loss16, *grads16 = _loss_and_grads(x16, mode, estimator, loss_mode)
    loss32, *grads32 = _loss_and_grads(up, mode, estimator, loss_mode)
    assert loss16.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads16)
    assert torch.equal(loss16, loss32)
    for g16, g32 in zip(grads16, grads32):
        assert torch.equal(g16, g32.bfloat16())
