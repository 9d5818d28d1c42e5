"""The decoupled PPO loss of an async run (algorithm.off_policy_loss): the clip on pi/pi_prox,
the behaviour weight pi_prox/pi_behaviour masked (decoupled) or capped (tis) at the cap, checked
against an independent per-token formula, and equal to today's loss when behaviour == proximal.
"""

import math

import pytest
import torch

from megatron_agent.rl import compute_policy_loss, rollout_is_weights

CLIP, CLIP_C, CAP = 0.2, 3.0, 2.0


def reference_loss(logp, prox, behav, adv, mask, mode: str) -> float:
    """Token-mean decoupled PPO loss, one token at a time in Python floats."""
    total, count = 0.0, 0
    for row in range(len(logp)):
        for t in range(len(logp[row])):
            if not mask[row][t]:
                continue
            r = math.exp(logp[row][t] - prox[row][t])
            w = math.exp(prox[row][t] - behav[row][t])
            w = min(w, CAP) if mode == "truncate" else (w if w <= CAP else 0.0)
            a = adv[row][t]
            loss = max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP))
            if a < 0:
                loss = min(loss, -a * CLIP_C)
            total += w * loss
            count += 1
    return total / max(count, 1)


def decoupled_loss(logp, prox, behav, adv, mask, mode: str) -> torch.Tensor:
    weights, _ = rollout_is_weights(behav, prox, mask, level="token", cap=CAP, mode=mode)
    loss, _ = compute_policy_loss(
        logp,
        prox,
        adv,
        mask,
        clip_ratio_low=CLIP,
        clip_ratio_high=CLIP,
        clip_ratio_c=CLIP_C,
        rollout_is_weights=weights,
    )
    return loss


@pytest.mark.parametrize("mode", ["mask", "truncate"])  # decoupled, tis
@pytest.mark.parametrize("seed", range(6))
def test_the_decoupled_loss_matches_an_independent_formula(mode, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 7)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    prox = logp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    behav = prox + torch.randn(shape, generator=g, dtype=torch.float64) * 0.8  # stale: some w > CAP
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    got = decoupled_loss(logp.float(), prox.float(), behav.float(), adv.float(), mask, mode)
    want = reference_loss(logp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), mode)
    assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", ["mask", "truncate"])
def test_with_behaviour_equal_to_proximal_it_is_todays_loss_exactly(mode):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 9, generator=g) * 3).requires_grad_()
    prox = logp.detach() + torch.randn(4, 9, generator=g) * 0.3
    adv, mask = torch.randn(4, 9, generator=g), (torch.rand(4, 9, generator=g) > 0.2).float()
    plain, _ = compute_policy_loss(logp, prox, adv, mask, clip_ratio_c=CLIP_C)
    (grad_plain,) = torch.autograd.grad(plain, logp)
    coupled = decoupled_loss(logp, prox, prox.clone(), adv, mask, mode)
    (grad_coupled,) = torch.autograd.grad(coupled, logp)
    assert torch.equal(coupled, plain) and torch.equal(grad_coupled, grad_plain)
