"""`sft_step` on real megatron-core (gloo, 2 ranks): the loss falls, is the global token mean,
and is the same whether the batch runs on one data-parallel rank (TP2 or PP2) or on two (DP2)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_torchrun


@pytest.fixture(scope="module")
def sft_results(tmp_path_factory):
    from megatron_agent.models.tiny import make_quickstart_model

    root = tmp_path_factory.mktemp("sft_step")
    model = make_quickstart_model(root / "model", seed=3, num_hidden_layers=2)
    out = root / "results.json"
    run_torchrun(["tests/train/sft_worker.py", "--model", str(model), "--out", str(out)], nproc=2)
    return json.loads(out.read_text())


def test_loss_is_global_mean_and_falls(sft_results):
    for layout, ranks in sft_results.items():
        expected = [r["expected_first"] for r in ranks if r["expected_first"] is not None]
        for r in ranks:
            losses = [s["sft/loss"] for s in r["steps"]]
            # Every rank reports the same numbers (broadcast from the last stage, summed over DP).
            assert losses == [s["sft/loss"] for s in ranks[0]["steps"]], layout
            assert losses[0] == pytest.approx(expected[0], rel=1e-5), layout
            assert losses[-1] < losses[0] - 0.05, (layout, losses)
            assert all(s["sft/update_successful"] == 1.0 for s in r["steps"])
            assert all(s["actor/grad_norm"] > 0 for s in r["steps"])


def test_dp_split_does_not_change_the_step(sft_results):
    dp2 = sft_results["1x1"]
    assert dp2[0]["dp"] == 2 and set(dp2[0]["rows"]).isdisjoint(dp2[1]["rows"])
    # The ranks hold different numbers of loss tokens: a per-rank mean would differ from this.
    assert dp2[0]["local_tokens"] != dp2[1]["local_tokens"]
    assert dp2[0]["steps"][0]["sft/tokens"] == dp2[0]["local_tokens"] + dp2[1]["local_tokens"]
    assert dp2[0]["steps"][0]["sft/tokens"] == sft_results["2x1"][0]["steps"][0]["sft/tokens"]
    for layout in ("2x1", "1x2"):
        assert sft_results[layout][0]["dp"] == 1
        for a, b in zip(sft_results[layout][0]["steps"], dp2[0]["steps"]):
            assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=2e-4, abs=1e-5), layout
            assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=2e-3), layout
