"""The critic's clipped value loss, explained variance and GAE over multi-turn masks, against
independent references (numpy formulas, a serial loop over the model's own tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_agent.rl.advantages import compute_advantages, gae_returns
from megatron_agent.rl.value_loss import clipped_value_loss, explained_variance


def _batch(seed: int, rows: int = 4, cols: int = 9):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=g)
    old = values + 0.5 * torch.randn(rows, cols, generator=g)
    returns = torch.randn(rows, cols, generator=g)
    mask = torch.rand(rows, cols, generator=g) > 0.3
    return values, old, returns, mask


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("clip", [0.05, 0.5, 100.0])
def test_clipped_value_loss_against_numpy(seed, clip):
    values, old, returns, mask = _batch(seed)
    # Garbage at masked positions must not leak into anything.
    values = torch.where(mask, values, torch.tensor(float("nan")))
    loss, sums = clipped_value_loss(values, old, returns, mask, cliprange_value=clip, normalizer=7.0)
    v, o, r = (t.numpy().astype(np.float64) for t in (values, old, returns))
    m = mask.numpy()
    v = np.where(m, v, 0.0)
    clipped = o + np.clip(v - o, -clip, clip)
    per_token = 0.5 * np.maximum((v - r) ** 2, (clipped - r) ** 2)
    assert float(loss) == pytest.approx(per_token[m].sum() / 7.0, rel=1e-5)
    binds = (np.abs(v - o) > clip) & ((clipped - r) ** 2 > (v - r) ** 2)
    assert float(sums["vf_clipped_sum"]) == binds[m].sum()
    if clip == 100.0:  # no clip reached: the plain squared error
        assert float(loss) == pytest.approx(0.5 * ((v - r) ** 2)[m].sum() / 7.0, rel=1e-5)


def test_the_gradient_stops_beyond_the_clip():
    old, returns = torch.zeros(1, 2), torch.tensor([[5.0, 5.0]])
    values = torch.tensor([[0.1, 3.0]], requires_grad=True)  # within, and beyond, a 0.5 clip
    loss, _ = clipped_value_loss(
        values, old, returns, torch.ones(1, 2, dtype=torch.bool), cliprange_value=0.5, normalizer=1.0
    )
    loss.backward()
    # token 0: clipped == unclipped region, gradient (v - R); token 1: the clipped error is
    # larger ((0.5 - 5)^2 > (3 - 5)^2), and it does not depend on v: no gradient
    assert values.grad[0].tolist() == pytest.approx([0.1 - 5.0, 0.0])


def test_explained_variance_against_numpy_on_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(200, generator=g)
    values = returns + 0.3 * torch.randn(200, generator=g)
    want = 1 - np.var((returns - values).numpy()) / np.var(returns.numpy())
    assert explained_variance(values, returns) == pytest.approx(want, rel=1e-6)
    # over the whole batch, not the mean of per-micro-batch figures
    halves = [
        explained_variance(values[:100], returns[:100]),
        explained_variance(values[100:], returns[100:]),
    ]
    assert explained_variance(values, returns) != pytest.approx(sum(halves) / 2, rel=1e-9)
    assert np.isnan(explained_variance(values[:5], torch.ones(5)))


def serial_gae(rewards, values, mask, gamma, lam):
    """Reference: GAE over each row's model tokens only (the masked ones do not exist for it)."""
    adv = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            running = delta + gamma * lam * running
            adv[b, t], next_value = running, values[b, t]
    return adv


@pytest.mark.parametrize("seed", range(8))
def test_gae_over_multi_turn_masks_against_a_serial_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rows, cols = 5, 30
    # turns of model tokens separated by tool/template tokens (mask 0), the reward on the last model token
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    for b in range(rows):
        t = int(torch.randint(0, 3, (1,), generator=g))
        while t < cols:
            n = int(torch.randint(1, 6, (1,), generator=g))
            mask[b, t : t + n] = True
            t += n + int(torch.randint(1, 5, (1,), generator=g))
    rewards = torch.zeros(rows, cols)
    for b in range(rows):
        if mask[b].any():
            rewards[b, int(mask[b].nonzero()[-1])] = float(torch.randn(1, generator=g))
    values = torch.randn(rows, cols, generator=g)
    gamma, lam, lam_critic = 0.97, 0.9, 1.0
    adv, returns = compute_advantages(
        "gae", rewards, mask, values_BT=values, gamma=gamma, lam=lam, whiten_gae=False, lam_critic=lam_critic
    )
    r, v, m = rewards.double().numpy(), values.double().numpy(), mask.numpy()
    want_adv = serial_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), np.where(m, want_adv, 0.0), rtol=1e-5, atol=1e-5)
    want_returns = serial_gae(r, v, m, gamma, lam_critic) + v
    np.testing.assert_allclose(returns.numpy(), np.where(m, want_returns, 0.0), rtol=1e-5, atol=1e-5)
    # a turn's last model token bootstraps from the next turn's first (not from a tool token)
    b = int(torch.nonzero(mask.sum(1) > 6)[0])
    steps = mask[b].nonzero()[:, 0].tolist()
    gaps = [i for i in range(len(steps) - 1) if steps[i + 1] > steps[i] + 1]
    if gaps:
        t, t_next = steps[gaps[0]], steps[gaps[0] + 1]
        delta = r[b, t] + gamma * v[b, t_next] - v[b, t]
        assert want_adv[b, t] == pytest.approx(delta + gamma * lam * want_adv[b, t_next])


@pytest.mark.parametrize("seed", range(4))
def test_returns_of_a_micro_batch_are_the_whole_batchs_rows_bit_for_bit(seed):
    """What the critic's update relies on when it computes the returns from its own forward
    (`critic.values=auto`): rows taken in another order and padded to another length give the
    returns `compute_advantages` gives on the whole batch, exactly."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = 6, 25
    lengths = torch.randint(3, cols + 1, (rows,), generator=g)
    mask = torch.rand(rows, cols, generator=g) > 0.3
    mask &= torch.arange(cols)[None, :] < lengths[:, None]
    rewards, values = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)
    gamma, lam, lam_critic = 0.99, 0.95, 0.8
    _, want = compute_advantages(
        "gae", rewards, mask, values_BT=values, gamma=gamma, lam=lam, lam_critic=lam_critic
    )
    pick = [4, 1, 3]
    width = int(lengths[pick].max())
    got = gae_returns(
        rewards[pick, :width], values[pick, :width], mask[pick, :width], gamma=gamma, lam=lam_critic
    )
    assert torch.equal(got, want[pick, :width])
    assert not want[pick, width:].any()
