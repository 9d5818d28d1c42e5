import math

import pytest
import torch

from megatron_agent.rl import (
    AdaptiveKLController,
    apply_kl_in_reward,
    make_kl_controller,
    mismatch_metrics,
    rollout_is_weights,
)

OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]])
ROLLOUT = torch.tensor([[-1.2, -1.0, -0.5, float("nan")], [-1.0, -2.0, -1.5, -1.0]])
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])
# old - rollout on loss tokens: 0.2, -1.0, 0.0 | 0.0, 1.0


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(ROLLOUT, OLD, MASK, thresholds=(0.1, 0.5))
    torch.testing.assert_close(m["mean_abs_diff"], torch.tensor(2.2 / 5))
    torch.testing.assert_close(m["max_abs_diff"], torch.tensor(1.0))
    torch.testing.assert_close(m["mean_diff"], torch.tensor(0.2 / 5))
    exp_mean = (math.exp(0.2) + 2 * math.e + 2) / 5
    torch.testing.assert_close(m["mean_exp_abs_diff"], torch.tensor(exp_mean))
    torch.testing.assert_close(m["frac_abs_diff_gt_0.1"], torch.tensor(3 / 5))
    torch.testing.assert_close(m["frac_abs_diff_gt_0.5"], torch.tensor(2 / 5))
    assert m["num_tokens"] == 5


def test_token_and_sequence_is_weights():
    w, m = rollout_is_weights(ROLLOUT, OLD, MASK, level="token", cap=2.0)
    expected = torch.tensor([[math.exp(0.2), math.exp(-1.0), 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(m["is_capped_frac"], torch.tensor(1 / 5))
    torch.testing.assert_close(m["is_weight_max"], torch.tensor(math.e))
    wm, _ = rollout_is_weights(ROLLOUT, OLD, MASK, level="token", cap=2.0, mode="mask")
    assert wm[1, 1] == 0.0 and wm[0, 0] == w[0, 0]
    ws, _ = rollout_is_weights(ROLLOUT, OLD, MASK, level="sequence", cap=2.0)
    torch.testing.assert_close(ws, torch.tensor([[math.exp(-0.8)] * 3 + [0.0], [2.0, 2.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="unknown rollout IS level"):
        rollout_is_weights(ROLLOUT, OLD, MASK, level="turn")


def test_kl_in_reward_and_controllers():
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    logp = torch.tensor([[-1.0, -0.5, float("nan")]])
    ref = torch.tensor([[-1.5, -0.5, -1.0]])
    mask = torch.tensor([[True, True, False]])
    out, m = apply_kl_in_reward(rewards, logp, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.0, 5.0]]))
    torch.testing.assert_close(m["kl_reward"], torch.tensor(0.25))

    fixed = make_kl_controller("fixed", 0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    ctrl = make_kl_controller("adaptive", 0.1, target_kl=0.5, horizon=100)
    ctrl.update(1.0, 10)  # error clipped to +0.2 -> 0.1 * 1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(0.4, 50)  # error -0.2 -> * 0.9
    assert ctrl.value == pytest.approx(0.102 * 0.9)
    restored = AdaptiveKLController(1.0, 0.5, 100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    with pytest.raises(ValueError, match="unknown KL controller"):
        make_kl_controller("pid", 0.1)
