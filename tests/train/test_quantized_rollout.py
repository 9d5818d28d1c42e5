"""Quantized rollout weights in the real trainer (vLLM engine, Megatron rank, Ray): NVFP4 weights
dequantized into the engine (`rollout.quantization=nvfp4_qdq`) open a policy gap that the
mismatch metrics measure; quantization-aware training (`actor.qat=nvfp4_w4a16`) closes it, the
actor computing with the engine's weights; a QAT run resumed from its checkpoint repeats the
uninterrupted one (QAT keeps no state of its own: its scales come from the restored weights)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY_QUICKSTART, metrics_by_step, train_quickstart
from tests.train.test_deterministic_resume import WALL_CLOCK, _assert_same_dump, _assert_same_step

TINY = [
    *TINY_QUICKSTART,
    "trainer.deterministic=true",
    "logging.plot=false",
    "logging.progress_bars=false",
    "trainer.total_steps=2",
    "rollout.quantization=nvfp4_qdq",
]


def _run(run_dir, *overrides) -> dict[int, dict]:
    train_quickstart(run_dir, *TINY, *overrides)
    return metrics_by_step(run_dir)


def _dumps(run_dir, step: int) -> list[dict]:
    lines = (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    fields = ("uid", "response_ids", "token_source", "rollout_logprobs", "old_logprobs", "advantages")
    return [{k: json.loads(line)[k] for k in fields} for line in lines]


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory):
    """A QAT run of two steps with a checkpoint after each: (its folder, its metrics)."""
    run_dir = tmp_path_factory.mktemp("qat")
    return run_dir, _run(run_dir, "actor.qat=nvfp4_w4a16", "checkpoint.save_freq=1")


def test_qat_closes_the_policy_gap_of_nvfp4_rollout_weights(qat_run, tmp_path):
    plain = _run(tmp_path / "plain", "checkpoint.save_freq=0", "trainer.total_steps=1")
    qat = qat_run[1]
    gap = {
        name: [m[s]["mismatch/mean_abs_diff"] for s in steps]
        for name, m, steps in (("plain", plain, [1]), ("qat", qat, [1, 2]))
    }
    ratio = min(gap["plain"]) / max(max(gap["qat"]), 1e-9)
    print(f"mismatch/mean_abs_diff without QAT {gap['plain']}, with QAT {gap['qat']}: {ratio:.3g}x smaller")
    assert min(gap["plain"]) > 1e-2  # NVFP4 weights: a gap far above fp32's (~1e-6)
    assert ratio >= 5
    # Either way the probe checks the sync alone, at fp32's tolerance: its actor forward computes
    # with the engine's quantized weights (QAT's, or switched on for the probe only).
    assert plain[0]["sync/probe_max_abs"] < 1e-4 and qat[0]["sync/probe_max_abs"] < 1e-4
    assert plain[1]["mismatch/is_weight_max"] > 1.01  # truncated IS (rollout_is=auto) is at work


def test_a_qat_run_resumes_exactly(qat_run, tmp_path):
    """Resumed from the QAT run's step-1 checkpoint in another folder: step 2 samples the same
    tokens and trains to the same metrics (the log-prob quantities within 1e-5)."""
    qat_dir, qat = qat_run
    step_1 = qat_dir / "checkpoints" / "step_000001"
    resumed = _run(
        tmp_path / "resumed", "actor.qat=nvfp4_w4a16", "checkpoint.save_freq=0", f"trainer.resume={step_1}"
    )
    assert not (tmp_path / "resumed" / "rollouts" / "step_000001.jsonl").exists()  # step 1 not rerun

    def comparable(m):  # every metric but the wall-clock ones
        return {k: v for k, v in m[2].items() if not k.startswith(WALL_CLOCK) and not k.endswith("_s")}

    _assert_same_step(comparable(resumed), comparable(qat), 2)
    _assert_same_dump(_dumps(tmp_path / "resumed", 2), _dumps(qat_dir, 2), 2)
