import math

import pytest
import torch
from rl_reference import ref_kl

from megatron_agent.rl import kl_penalty
from megatron_agent.rl.kl import KL_ALIASES, KL_ESTIMATORS, compute_kl_loss

D = [0.5, -1.0, 0.0]
E = math.e
HAND = {
    "k1": ([0.5, -1.0, 0.0], [1.0, 1.0, 1.0]),
    "abs": ([0.5, 1.0, 0.0], [1.0, -1.0, 0.0]),
    "k2": ([0.125, 0.5, 0.0], [0.5, -1.0, 0.0]),
    "k3": ([math.exp(-0.5) - 0.5, E - 2.0, 0.0], [1 - math.exp(-0.5), 1 - E, 0.0]),
    "k1+": ([0.5, -1.0, 0.0], [0.5, -1.0, 0.0]),
    "k3+": ([math.exp(-0.5) - 0.5, E - 2.0, 0.0], [0.5, -1.0, 0.0]),
}


@pytest.mark.parametrize("estimator", list(HAND) + list(KL_ALIASES))
def test_estimators_by_hand(estimator):
    value, grad = HAND[KL_ALIASES.get(estimator, estimator)]
    ref = torch.tensor([-1.5, -1.0, -0.5])
    logp = (ref + torch.tensor(D)).requires_grad_()
    ref = ref.clone().requires_grad_()
    kl = kl_penalty(logp, ref, estimator)
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl, torch.tensor(value), rtol=1e-6, atol=1e-6)
    kl.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor(grad), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref.grad, -torch.tensor(grad), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_matches_autograd_reference(estimator):
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(4, 16, generator=g) * 3).requires_grad_()
    ref = torch.randn(4, 16, generator=g) * 3
    ours = kl_penalty(logp, ref, estimator)
    (gours,) = torch.autograd.grad(ours.sum(), logp)
    theirs = ref_kl(logp, ref, estimator)
    (gtheirs,) = torch.autograd.grad(theirs.sum(), logp)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(gours, gtheirs)


def test_k3_clamps_keep_value_and_gradient_finite():
    ref = torch.zeros(4)
    logp = torch.tensor([-100.0, -25.0, 25.0, 100.0], requires_grad=True)
    kl = kl_penalty(logp, ref, "k3")
    assert torch.all(kl <= 10.0) and torch.isfinite(kl).all()
    assert kl[0] == 10.0 and kl[3] == 10.0  # exp(20) - 21 and 19, both clamped to 10
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_mask_stops_nan_in_value_and_gradient():
    logp = torch.tensor([[-1.0, float("nan"), float("inf")]], requires_grad=True)
    ref = torch.tensor([[-0.5, -1.0, float("-inf")]])
    mask = torch.tensor([[True, False, False]])
    loss, metrics = compute_kl_loss(logp, ref, mask, estimator="k3")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 2] == 0
    torch.testing.assert_close(loss, torch.tensor(math.exp(0.5) - 0.5 - 1))
    torch.testing.assert_close(metrics["kl_max"], loss.detach())


def test_unknown_estimator_is_a_value_error():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
