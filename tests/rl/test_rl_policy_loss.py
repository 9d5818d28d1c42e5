import math

import pytest
import torch
from rl_reference import ref_policy_loss_BT, ref_token_mean

from megatron_agent.rl import agg_loss, compute_policy_loss, token_policy_loss


def _hand_batch():
    # t0 inside the clip range, t1 clipped above (A > 0), t2 clipped below (A < 0),
    # t3 dual-clipped (A < 0, r = 4 > c = 3), t4 A < 0 under the dual-clip bound, t5 masked.
    ratios = [1.1, 1.5, 0.5, 4.0, 2.0, 1.0]
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5, -1.0]])
    logp = (old + torch.log(torch.tensor([ratios]))).clone()
    logp[0, 5] = float("nan")
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0, float("nan")]])
    mask = torch.tensor([[True, True, True, True, True, False]])
    return logp.requires_grad_(), old, adv, mask, ratios


def test_vanilla_by_hand():
    logp, old, adv, mask, ratios = _hand_batch()
    loss, m = compute_policy_loss(logp, old, adv, mask)
    # per-token: -1.1, -1.2, 0.8, 3.0 (dual clip), 4.0 -> mean over 5 tokens
    torch.testing.assert_close(loss, torch.tensor(5.5 / 5))
    loss.backward()
    # d/dlogp = -A * r on the unclipped branch, 0 on clipped ones, 0 where masked
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1 / 5, 0.0, 0.0, 0.0, 4.0 / 5, 0.0]]))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(0.4))
    torch.testing.assert_close(m["pg_clipfrac_lower"], torch.tensor(0.2))
    log_r = [math.log(r) for r in ratios[:5]]
    torch.testing.assert_close(m["ppo_kl"], torch.tensor(-sum(log_r) / 5))
    torch.testing.assert_close(m["max_abs_log_ratio"], torch.tensor(math.log(4.0)))
    assert m["pg_loss"] == loss.detach()


def test_asymmetric_clip_and_weights_by_hand():
    logp, old, adv, mask, _ = _hand_batch()
    w = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.5, float("nan")]])
    # clip_ratio_high=0.6: t1 (r=1.5) is no longer clipped
    loss, m = compute_policy_loss(logp, old, adv, mask, clip_ratio_high=0.6, rollout_is_weights=w)
    torch.testing.assert_close(loss, torch.tensor((-2.2 - 1.5 + 0.8 + 3.0 + 2.0) / 5))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.2 / 5, -1.5 / 5, 0.0, 0.0, 2.0 / 5, 0.0]]))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(0.2))


def test_gspo_by_hand():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.0, 0.2, 5.0], [0.1, 0.3, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.ones(2, 3)
    loss, m = compute_policy_loss(logp, old, adv, mask, loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")
    s0 = math.exp(0.1)  # row 0: seq ratio exp(mean(0, 0.2)) inside [0.8, 1.2]
    # row 1: exp(0.2) = 1.2214 > 1.2, clipped at 1.2
    torch.testing.assert_close(loss, torch.tensor((-s0 - 1.2) / 2))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(0.5))


@pytest.mark.parametrize("mode", ["vanilla", "gspo"])
@pytest.mark.parametrize("low,high,c", [(0.2, 0.2, 3.0), (0.2, 0.28, 10.0), (0.0003, 0.0004, 3.0)])
def test_matches_autograd_reference(mode, low, high, c):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4, 12, generator=g) - 2
    logp = (old + torch.randn(4, 12, generator=g) * 0.5).requires_grad_()
    adv = torch.randn(4, 12, generator=g)
    mask = torch.rand(4, 12, generator=g) > 0.3
    w = torch.rand(4, 12, generator=g) * 2
    loss_BT, _ = token_policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
        rollout_is_weights=w,
        loss_mode=mode,
    )
    (ours,) = torch.autograd.grad(agg_loss(loss_BT, mask), logp)
    ref_BT = ref_policy_loss_BT(logp, old, adv, mask, low, high, c, weights=w, mode=mode)
    (theirs,) = torch.autograd.grad(ref_token_mean(ref_BT, mask), logp)
    torch.testing.assert_close(loss_BT, ref_BT)
    torch.testing.assert_close(ours, theirs)


def test_injected_token_cannot_make_the_loss_nan():
    # The seed bug: a huge gap on a loss token is clamped (loss finite, but see the guard).
    old = torch.tensor([[-0.01, -1.0]])
    logp = torch.tensor([[-30.0, -1.0]], requires_grad=True)
    loss, m = compute_policy_loss(logp, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    torch.testing.assert_close(m["max_abs_log_ratio"], torch.tensor(29.99))


def test_bad_arguments_are_value_errors():
    x = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        compute_policy_loss(x, x, x, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="unknown loss_mode 'ppo2'"):
        compute_policy_loss(x, x, x, mask, loss_mode="ppo2")
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        compute_policy_loss(x, x, x, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(x, x, torch.zeros(2, 2), mask)
