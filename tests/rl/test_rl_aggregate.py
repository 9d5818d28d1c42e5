import pytest
import torch

from megatron_agent.rl import agg_loss, global_batch_counts

LOSS = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, float("inf"), 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[True, True, True, False], [True, False, False, False], [False] * 4])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / (2 * 4)),
    ],
)
def test_modes_by_hand(mode, expected):
    loss_BT = LOSS.clone().requires_grad_()
    out = agg_loss(loss_BT, MASK, mode)
    torch.testing.assert_close(out, torch.tensor(expected))
    out.backward()
    assert torch.isfinite(loss_BT.grad).all() and (loss_BT.grad[~MASK] == 0).all()


def test_horizon_and_empty_mask():
    torch.testing.assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", horizon=10), torch.tensor(0.5))
    empty = torch.zeros_like(MASK)
    for mode in ("token-mean", "seq-mean-token-mean"):
        assert agg_loss(LOSS, empty, mode) == 0.0


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batches_sum_to_the_global_loss(mode):
    g = torch.Generator().manual_seed(0)
    loss_BT = torch.randn(6, 5, generator=g)
    mask_BT = torch.rand(6, 5, generator=g) > 0.4
    mask_BT[2] = False
    whole = agg_loss(loss_BT, mask_BT, mode)
    micro = [slice(0, 1), slice(1, 4), slice(4, 6)]
    counts = global_batch_counts([mask_BT[s] for s in micro])
    assert counts.num_tokens == int(mask_BT.sum()) and counts.num_seqs == 5
    total = sum(
        agg_loss(
            loss_BT[s], mask_BT[s], mode, num_tokens=counts.num_tokens, num_seqs=counts.num_seqs, horizon=5
        )
        for s in micro
    )
    torch.testing.assert_close(total, whole)


def test_errors():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'sum'"):
        agg_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="differ in shape"):
        agg_loss(LOSS, MASK[:, :2])
