"""The driver-side stages of the RL step that need no worker: IS weights and mismatch metrics."""

import math

import torch

from megatron_agent.config import load_config
from megatron_agent.train.batch import RLBatch
from megatron_agent.train.rl_loop import importance_weights
from megatron_agent.train.step_stats import mismatch


def _batch() -> RLBatch:
    # Two sequences of 4 targets; the engine's log-probs are 0.5 above the trainer's on one token.
    rollout = [torch.tensor([0.0, -1.0, -1.0, -2.0]), torch.tensor([0.0, -0.5, -1.0, 0.0])]
    old = [torch.tensor([0.0, -1.0, -1.5, -2.0]), torch.tensor([0.0, -0.5, -1.0, 0.0])]
    mask = [torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0, 0.0])]
    batch = RLBatch(
        uids=["a/0", "a/1"], group_ids=["a", "a"], sequences=[[1] * 5, [1] * 5], rewards=torch.zeros(2)
    )
    batch.tensors.update(rollout_logp=rollout, old_logp=old, loss_mask=mask)
    return batch


def test_token_is_weights_are_capped_and_mismatch_counts_loss_tokens():
    algo = load_config(None, ["algorithm.rollout_is_cap=1.2"]).algorithm
    batch = _batch()
    mask_BT = batch.padded("loss_mask")
    w_BT, metrics = importance_weights(batch, mask_BT, algo, "token", algo.rollout_is_mode)
    # weight = exp(old - rollout): exp(-0.5) on the differing token, 1 elsewhere on loss tokens
    assert math.isclose(float(w_BT[0, 2]), math.exp(-0.5), rel_tol=1e-6)
    assert float(w_BT[0, 1]) == 1.0 and metrics["mismatch/is_capped_frac"] == 0.0
    m = mismatch(batch, mask_BT, algo)
    assert m["mismatch/num_tokens"] == 5.0 and math.isclose(m["mismatch/max_abs_diff"], 0.5, rel_tol=1e-6)
    assert math.isclose(m["mismatch/frac_abs_diff_gt_0.1"], 1 / 5, rel_tol=1e-6)


def test_the_update_computes_the_same_is_weights_as_the_driver():
    # On-policy steps take the old (proximal) log-probs from the update's own forward and compute
    # the rollout IS weights inside the loss, micro-batch by micro-batch: the same weights as the
    # driver's stage computes from a forward-only pass (here: the same old log-probs).
    from megatron_agent.train.actor_update import PPOUpdate

    batch = _batch()
    mask_BT = batch.padded("loss_mask")
    for level in ("token", "sequence"):
        for mode, cap in (("truncate", 1.2), ("mask", 1.0)):
            algo = load_config(None, [f"algorithm.rollout_is_cap={cap}"]).algorithm
            want, _ = importance_weights(batch, mask_BT, algo, level, mode)
            update = PPOUpdate(
                None, algo, None, None, None, horizon=8, old_from_update=True, rollout_is=(level, mode)
            )
            extras = {"rollout_logp": batch.padded("rollout_logp"), "old_logp": batch.padded("old_logp")}
            got = update.is_weights(extras, mask_BT.bool())
            assert torch.equal(got, want), (level, mode)
            assert bool((got != 1.0)[mask_BT.bool()].any()), (level, mode)  # the case is not trivial
