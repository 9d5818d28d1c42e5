"""The critic (models/value_model.py): the same values at every TP x PP layout, a head that
starts small and is drawn the same on every rank, and a value loss that falls.

One torchrun launch (4 gloo ranks) computes everything; the assertions run here.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_torchrun

LAYOUTS = ["1x1", "2x1", "1x2", "2x2", "1x2v2"]


@pytest.fixture(scope="module")
def results(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("critic") / "results.json"
    run_torchrun(
        [
            "tests/helpers/critic_worker.py",
            "--model",
            str(tiny_models["llama_tied"]),  # tied: the head must replace, not share, the embedding
            "--layouts",
            *LAYOUTS,
            "--train-layout",
            "2x1",
            "--out",
            str(out),
        ],
        nproc=4,
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_values_are_equal_at_every_layout(results, layout):
    reference = [torch.tensor(v) for v in results["values"]["1x1"]]
    got = [torch.tensor(v) for v in results["values"][layout]]
    assert [len(v) for v in got] == [len(v) for v in reference]
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_head_starts_small_and_values_differ_between_positions(results):
    values = torch.cat([torch.tensor(v) for v in results["values"]["1x1"]])
    # std 1/sqrt(hidden + 1) on a normalised hidden state: values of order 1, not 0 and not 100
    assert 0.01 < values.abs().mean() < 5.0
    assert values.std() > 1e-3


def test_the_value_loss_falls_at_tp2_with_two_data_parallel_replicas(results):
    losses = results["train"]["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_nan_in_one_replicas_values_skips_the_step_on_every_rank(results):
    ranks = results["guard"]["ranks"]
    assert ranks == [{"unchanged": True, "skipped": 1}] * 4, ranks


def test_values_from_the_update_repeat_a_value_pass_and_its_step(results):
    """`critic.values=auto` on on-policy steps: the update's forward gives the values (the same as
    a value pass before it, 1e-5) and computes the returns micro-batch by micro-batch, with masked
    spans inside the rows; the optimizer step is the one the driver's whole-batch returns give."""
    passed, folded = results["fold"]["pass"], results["fold"]["update"]
    for a, b in zip(folded["values"], passed["values"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    assert len(folded["sums"]) == len(passed["sums"]) == 2  # one report per data-parallel replica
    for a, b in zip(folded["sums"], passed["sums"]):
        assert a["critic/guard_skipped"] == b["critic/guard_skipped"] == 0.0
        for key in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm", "n_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
        assert a["critic/vf_clipfrac"] == b["critic/vf_clipfrac"] == 0.0
    moved = max(
        (torch.tensor(a) - torch.tensor(b)).abs().max().item()
        for a, b in zip(passed["after"], passed["values"])
    )
    assert moved > 1e-3  # the step changed the values ...
    for a, b in zip(folded["after"], passed["after"]):  # ... the same way
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)
