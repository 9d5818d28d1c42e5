"""A run folder copied elsewhere resumes from its own files, and the adaptive KL controller's
state survives the checkpoint (issue 11, points 1 and 2 of the resume work).

The run trains 2 SFT steps (so the reference comes from `<run>/sft/checkpoint`) and 1 RL step
with the KL in the reward under an adaptive controller; the folder is then copied and the
original deleted, so that any absolute path stored in the checkpoint would point at nothing.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import TINY_SFT_RL, metrics_by_step, train_quickstart

TRAIN = [
    *TINY_SFT_RL,
    "trainer.test_freq=0",
    "logging.plot=false",
    "algorithm.kl_reward_coef=0.05",
    "algorithm.kl_ctrl=adaptive",
    "algorithm.kl_target=0.1",
    "algorithm.kl_horizon=10",  # 4 samples per step: the coefficient moves by up to 8% a step
]


def _train(run_dir, *overrides):
    return train_quickstart(run_dir, *TRAIN, *overrides)


def _driver(run_dir, step):
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "trainer" / "driver.json").read_text())


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """(saved driver state of step 1, the copy's folder, the resumed run's output)."""
    work = tmp_path_factory.mktemp("resume_paths")
    original = work / "original"
    _train(original, "trainer.total_steps=1")
    saved = _driver(original, 1)
    copy = work / "elsewhere" / "run"
    shutil.copytree(original, copy, ignore=shutil.ignore_patterns("logs", "vllm_cache"))
    shutil.rmtree(original)
    resumed = _train(copy, "trainer.total_steps=2")
    return saved, copy, resumed


def test_the_checkpoint_names_the_sft_reference_relative_to_the_run_folder(moved):
    saved, copy, _ = moved
    assert saved["ref_from"] == "sft/checkpoint"
    assert _driver(copy, 2)["ref_from"] == "sft/checkpoint"


def test_a_copied_run_folder_resumes_from_its_own_files(moved):
    _, copy, resumed = moved
    assert f"resumed from {copy / 'checkpoints' / 'step_000001'} (step 1)" in resumed.stdout
    assert "continuing at step 2" in resumed.stdout
    steps = sorted(metrics_by_step(copy))
    assert steps == [-2, -1, 0, 1, 2]  # SFT, validation, RL step 1 before the copy; step 2 after


def test_adaptive_kl_controller_state_round_trips_through_the_checkpoint(moved):
    saved, copy, _ = moved
    metrics = metrics_by_step(copy)
    start = 0.05
    assert metrics[1]["critic/kl_coef"] == start
    value_1 = saved["kl_ctrl"]["value"]
    error_1 = min(max(metrics[1]["critic/kl_reward"] / 0.1 - 1, -0.2), 0.2)
    assert value_1 == pytest.approx(start * (1 + error_1 * 4 / 10), rel=1e-12) and value_1 != start
    assert metrics[2]["critic/kl_coef"] == value_1  # restored, not restarted at kl_reward_coef
    error_2 = min(max(metrics[2]["critic/kl_reward"] / 0.1 - 1, -0.2), 0.2)
    assert _driver(copy, 2)["kl_ctrl"]["value"] == pytest.approx(value_1 * (1 + error_2 * 4 / 10), rel=1e-12)


# ------------------------------------------------------------------------------- driver side only
def test_paths_inside_the_run_folder_are_stored_relative(tmp_path):
    from megatron_agent.train.run_state import portable_path

    run = tmp_path / "run"
    assert portable_path(run / "sft" / "checkpoint", run) == "sft/checkpoint"
    assert portable_path(tmp_path / "other" / "ckpt", run) == str(tmp_path / "other" / "ckpt")


def test_resolve_ref_from_looks_in_the_run_folder_then_the_checkpoints_own(tmp_path):
    from megatron_agent.train.run_state import resolve_ref_from

    old_run, new_run = tmp_path / "old", tmp_path / "new"
    (old_run / "sft" / "checkpoint").mkdir(parents=True)
    resume_dir = old_run / "checkpoints" / "step_000003"  # trainer.resume=PATH into another run
    assert resolve_ref_from("sft/checkpoint", new_run, resume_dir) == old_run / "sft" / "checkpoint"
    (new_run / "sft" / "checkpoint").mkdir(parents=True)
    assert resolve_ref_from("sft/checkpoint", new_run, resume_dir) == new_run / "sft" / "checkpoint"
    with pytest.raises(FileNotFoundError, match="copy the run folder whole"):
        resolve_ref_from("sft/missing", new_run, resume_dir)
    with pytest.raises(FileNotFoundError, match="gone/ckpt"):
        resolve_ref_from(str(tmp_path / "gone" / "ckpt"), new_run, resume_dir)
