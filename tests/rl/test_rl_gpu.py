"""The RL core on a CUDA device: same numbers as on the CPU, bf16 equal to its fp32 upcast."""

import pytest
import torch

from megatron_agent.rl import GuardBatch, StepGuard, compute_kl_loss, compute_policy_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _loss(logp, old, ref, adv, mask):
    pg, m = compute_policy_loss(logp, old, adv, mask)
    kl, _ = compute_kl_loss(logp, ref, mask, estimator="k3+")
    return pg + 0.1 * kl, m


def test_cuda_matches_cpu_and_bf16_matches_fp32_upcast(tmp_path):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 256, generator=g) * 4
    logp = old + torch.randn(8, 256, generator=g) * 0.5
    ref, adv = old - 0.1, torch.randn(8, 256, generator=g)
    mask = torch.rand(8, 256, generator=g) > 0.3
    logp[~mask] = float("nan")
    outs = {}
    for device in ("cpu", "cuda"):
        x = logp.to(device).requires_grad_()
        loss, _ = _loss(x, old.to(device), ref.to(device), adv.to(device), mask.to(device))
        loss.backward()
        outs[device] = (loss.detach().cpu(), x.grad.cpu())
    torch.testing.assert_close(outs["cuda"][0], outs["cpu"][0])
    torch.testing.assert_close(outs["cuda"][1], outs["cpu"][1])
    x16 = logp.cuda().bfloat16()
    up = x16.float()
    l16, _ = _loss(x16, old.cuda().bfloat16(), ref.cuda().bfloat16(), adv.cuda().bfloat16(), mask.cuda())
    l32, _ = _loss(
        up,
        old.cuda().bfloat16().float(),
        ref.cuda().bfloat16().float(),
        adv.cuda().bfloat16().float(),
        mask.cuda(),
    )
    assert torch.equal(l16, l32)

    guard = StepGuard(tmp_path, console=False)
    bad = logp.clone().cuda()
    bad[0, 0] = -30.0
    m = mask.clone().cuda()
    m[0, 0] = True
    guard.observe(
        GuardBatch(
            logprob=bad, old_logprob=bad.new_full(bad.shape, -0.01), advantages=adv.cuda(), loss_mask=m
        )
    )
    decision = guard.check(0)
    assert decision.skip
