import math

import pytest
import torch

from megatron_agent.rl import compute_advantages


def _outcome(scores, lengths, t=4):
    """Rewards on each row's last response token; rows padded to t."""
    rewards = torch.zeros(len(scores), t)
    mask = torch.zeros(len(scores), t, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = True
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


GROUPS = ["a", "a", "b", "b", "c", "d", "d"]
SCORES = [1.0, 0.0, 2.0, 2.0, 5.0, 3.0, 1.0]
LENGTHS = [2, 3, 4, 1, 2, 2, 0]  # the last row has a zero-length response


def test_grpo_and_dr_grpo_by_hand():
    rewards, mask = _outcome(SCORES, LENGTHS)
    adv, ret = compute_advantages("grpo", rewards, mask, group_ids=GROUPS)
    std = math.sqrt(0.5)  # unbiased std of {1, 0}
    # group d: the empty row scores 0 and still counts in its group's baseline: {3, 0}
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0, 0, 0, 1.5 / (1.5 * math.sqrt(2) + 1e-6), 0]
    for i, e in enumerate(expected):
        torch.testing.assert_close(adv[i, : LENGTHS[i]], torch.full((LENGTHS[i],), float(e)))
    assert (adv[~mask] == 0).all() and torch.isfinite(adv).all()
    assert torch.equal(ret, adv)
    dr, _ = compute_advantages("grpo", rewards, mask, group_ids=GROUPS, norm_by_std=False)
    torch.testing.assert_close(dr[:, 0], torch.tensor([0.5, -0.5, 0, 0, 0, 1.5, 0]))


def test_rloo_by_hand():
    rewards, mask = _outcome([1.0, 0.0, 3.0, 4.0, 5.0, 7.0], [2, 2, 1, 1, 1, 1])
    adv, _ = compute_advantages("rloo", rewards, mask, group_ids=[0, 0, 1, 1, 1, 2])
    # score minus the mean of the others: 1-0, 0-1, 3-4.5, 4-4, 5-3.5, single -> 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, -1.5, 0.0, 1.5, 0.0]))


def test_equal_rewards_give_exact_zeros():
    rewards, mask = _outcome([0.1] * 3 + [0.7] * 5, [3] * 8)
    for est in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        adv, _ = compute_advantages(est, rewards, mask, group_ids=[0] * 3 + [1] * 5)
        assert torch.equal(adv, torch.zeros_like(adv)), est


def test_reinforce_plus_plus_discounts_and_skips_masked_positions():
    rewards = torch.tensor([[0.0, 9.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0]])
    mask = torch.tensor([[True, False, True, True], [True, True, True, False]])
    adv, ret = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=0.5)
    # row 0: the masked column (reward 9 ignored) is passed through: returns 0.25, -, 0.5, 1.0
    expected_ret = torch.tensor([[0.25, 0.0, 0.5, 1.0], [0.5, 1.0, 2.0, 0.0]])
    torch.testing.assert_close(ret, expected_ret)
    vals = expected_ret[mask]
    torch.testing.assert_close(adv[mask], (vals - vals.mean()) / (vals.std() + 1e-6))
    assert (adv[~mask] == 0).all()
    adv1, ret1 = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=1.0)
    torch.testing.assert_close(ret1, torch.tensor([[1.0, 0.0, 1.0, 1.0], [2.0, 2.0, 2.0, 0.0]]))


def test_reinforce_plus_plus_baseline_by_hand():
    rewards, mask = _outcome([1.0, 0.0, 3.0], [1, 2, 1])
    adv, ret = compute_advantages("reinforce_plus_plus_baseline", rewards, mask, group_ids=[0, 0, 1])
    # baseline-subtracted: 0.5, -0.5 (two tokens), 0 (group of one); then whitened over 4 tokens
    vals = torch.tensor([0.5, -0.5, -0.5, 0.0])
    torch.testing.assert_close(ret[mask], vals)
    torch.testing.assert_close(adv[mask], (vals - vals.mean()) / (vals.std() + 1e-6))


def test_remax_by_hand():
    rewards = torch.tensor([[0.5, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, ret = compute_advantages("remax", rewards, mask, baseline_rewards_B=torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.0], [1.5, 1.5, 0.0]]))


def test_gae_by_hand_and_through_masked_positions():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv, ret = compute_advantages(
        "gae", rewards, mask, values_BT=values, gamma=0.9, lam=0.8, whiten_gae=False
    )
    # t1: delta 1 - 0.2 = 0.8; t0: delta 0.9 * 0.2 - 0.5 = -0.32, gae -0.32 + 0.72 * 0.8 = 0.256
    torch.testing.assert_close(adv, torch.tensor([[0.256, 0.8]]))
    torch.testing.assert_close(ret, torch.tensor([[0.756, 1.0]]))
    # A masked tool-output column with garbage in the middle changes nothing.
    r3 = torch.tensor([[0.0, 5.0, 1.0]])
    v3 = torch.tensor([[0.5, float("nan"), 0.2]])
    m3 = torch.tensor([[True, False, True]])
    adv3, _ = compute_advantages("gae", r3, m3, values_BT=v3, gamma=0.9, lam=0.8, whiten_gae=False)
    torch.testing.assert_close(adv3, torch.tensor([[0.256, 0.0, 0.8]]))
    white, _ = compute_advantages("gae", rewards, mask, values_BT=values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(white.sum(), torch.tensor(0.0), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "est", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"]
)
def test_degenerate_batches_give_zeros_without_nan(est):
    rewards = torch.tensor([[float("nan"), 0.0], [1.0, 0.0]])
    mask = torch.tensor([[False, False], [True, False]])  # one empty row, one single-token row
    kwargs = dict(
        group_ids=["x", "y"], values_BT=torch.zeros(2, 2), baseline_rewards_B=torch.tensor([0.0, 1.0])
    )
    adv, ret = compute_advantages(est, rewards, mask, **kwargs)
    assert torch.equal(adv, torch.zeros_like(adv)) and torch.isfinite(ret).all()


def test_errors():
    rewards, mask = _outcome([1.0], [1])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", rewards, mask)
    with pytest.raises(ValueError, match="needs group_ids"):
        compute_advantages("grpo", rewards, mask)
    with pytest.raises(ValueError, match="needs values_BT"):
        compute_advantages("gae", rewards, mask)
    with pytest.raises(ValueError, match="needs baseline_rewards_B"):
        compute_advantages("remax", rewards, mask)
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        compute_advantages("grpo", rewards, mask, group_ids=[1, 2])
