"""Straightforward eager formulas (plain autograd) that the RL core is checked against."""

import torch


def ref_kl(logp, ref, estimator):
    d = logp.float() - ref.float()
    if estimator in ("k1", "kl"):
        return d
    if estimator == "abs":
        return d.abs()
    if estimator in ("k2", "mse"):
        return 0.5 * d**2
    kl = (-d).clamp(-20, 20)
    k3 = (torch.exp(kl) - kl - 1).clamp(-10, 10)
    if estimator in ("k3", "low_var_kl"):
        return k3
    k2 = 0.5 * d**2
    value = d if estimator == "k1+" else k3
    return k2 + (value - k2).detach()


def ref_policy_loss_BT(
    logp, old, adv, mask, low=0.2, high=0.2, c=3.0, clamp=20.0, weights=None, mode="vanilla"
):
    """Per-token loss (masked with where) using plain autograd."""
    mask = mask.bool()
    lr = torch.where(mask, logp.float() - old.float(), 0.0)
    if mode == "gspo":
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        seq = (lr.sum(-1, keepdim=True) / n).detach()
        lp = torch.where(mask, logp.float(), 0.0)
        lr = torch.where(mask, seq + lp - lp.detach(), 0.0)
    a = torch.where(mask, adv.float(), 0.0)
    ratio = torch.exp(lr.clamp(-clamp, clamp))
    l1 = -a * ratio
    l2 = -a * ratio.clamp(1 - low, 1 + high)
    cl1 = torch.maximum(l1, l2)
    if mode == "vanilla":
        cl2 = torch.minimum(-a * c, cl1)
        loss = torch.where(a < 0, cl2, cl1)
    else:
        loss = cl1
    if weights is not None:
        loss = loss * torch.where(mask, weights.float(), 0.0)
    return torch.where(mask, loss, 0.0)


def ref_token_mean(x, mask):
    mask = mask.bool()
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)
