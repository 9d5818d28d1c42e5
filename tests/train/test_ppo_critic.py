"""PPO with a critic (`algorithm.adv_estimator=gae`) end to end on CPU: the real trainer, Megatron
ranks over Ray, the vLLM engine, the critic on the actor's ranks or on ranks of its own.

One deterministic run of 4 steps (the first a critic warm-up step, a checkpoint every 2 steps),
one of 2 steps, and its resume to 4: the resumed steps must repeat the uninterrupted run's
(critic and actor alike), which needs the critic's weights, optimizer, LR schedule and guard in
the checkpoint. A run with the critic on ranks of its own, at another layout (PP2 against the
actor's PP1), must repeat the colocated run's steps, and its checkpoint must resume with the
critic back on the actor's ranks. The colocated runs take the critic's values from its update's
forward (`RunPlan.values_from_update`), the separate one from a value pass before its update:
the comparison also holds the two ways of computing them equal.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, TINY_QUICKSTART, metrics_by_step, train_quickstart

TINY_PPO = [
    *TINY_QUICKSTART,
    "checkpoint.save_freq=2",
    "trainer.deterministic=true",
    "logging.plot=false",
    "logging.progress_bars=false",
    "algorithm.adv_estimator=gae",
    "algorithm.lam=0.95",
    "critic.lr=1e-3",
    "trainer.critic_warmup=1",
]
WALL_CLOCK = ("timing_s/", "perf/", "sync/seconds", "sync/gbps", "startup")
# Two fresh runs already differ at the 1e-6..1e-5 level here (the SFT loss of step -2 did, in a
# measured pair; test_deterministic_resume.py says the same of the actor's quantities); a critic
# resumed without its optimizer state or schedule differs by orders of magnitude more.
TOL = dict(rel=1e-4, abs=1e-5)


def _run(run_dir, *overrides):
    return train_quickstart(run_dir, *TINY_PPO, *overrides)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    _run(run_dir, "trainer.total_steps=4")
    return run_dir


def test_a_gae_run_trains_the_critic_first_then_both(uninterrupted):
    m = metrics_by_step(uninterrupted)
    warmup, both = m[1], m[2]
    for key in (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
        "critic/values/mean",
        "critic/vf_explained_var",
        "timing_s/update_critic",
    ):
        assert key in warmup and key in both, key
    # on-policy steps with the critic on the actor's ranks: its update's forward gives the values
    assert "timing_s/values" not in warmup and "timing_s/values" not in both  # (critic.values=auto)
    assert "actor/pg_loss" not in warmup and "actor/pg_loss" in both  # trainer.critic_warmup=1
    assert all(m[s]["critic/guard_skipped"] == 0.0 for s in m if s >= 1)
    dump = [
        json.loads(line)
        for line in (uninterrupted / "rollouts" / "step_000002.jsonl").read_text().splitlines()
    ]
    assert all(len(row["values"]) == len(row["advantages"]) for row in dump)
    ckpt = uninterrupted / "checkpoints" / "step_000004"
    assert {p.name for p in (ckpt / "critic").iterdir()} == {"model", "optim", "update.pt"}


def test_the_critic_resumes_exactly(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    _run(run_dir, "trainer.total_steps=2")
    _run(run_dir, "trainer.total_steps=4")  # resumes from step 2
    want, got = metrics_by_step(uninterrupted), metrics_by_step(run_dir)
    for step in (3, 4):  # the same tokens sampled
        assert [r["response_ids"] for r in _dump(run_dir, step)] == [
            r["response_ids"] for r in _dump(uninterrupted, step)
        ]
    _assert_steps_equal(want, got, (3, 4))


def _assert_steps_equal(want: dict, got: dict, steps) -> None:
    """The metrics of `steps` (wall-clock figures aside) equal within TOL; counts exactly."""
    for step in steps:
        keys = [k for k in want[step] if not k.startswith(WALL_CLOCK) and not k.endswith("_s")]
        assert set(keys) <= set(got[step])
        for key in keys:
            if isinstance(want[step][key], float):
                assert got[step][key] == pytest.approx(want[step][key], **TOL), (step, key)
            else:
                assert got[step][key] == want[step][key], (step, key)


def _dump(run_dir, step: int) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    ]


def test_a_separate_critic_at_its_own_layout_repeats_the_colocated_run_and_resumes_on_the_actors_ranks(
    uninterrupted, tmp_path
):
    run_dir = tmp_path / "run"
    _run(run_dir, "trainer.total_steps=2", "critic.placement=separate", "critic.pp=2")
    want, got = metrics_by_step(uninterrupted), metrics_by_step(run_dir)
    assert "timing_s/startup/critic" in got[0]  # its ranks started beside the actor's
    # its value pass (not its update's forward: critic.values=auto runs one when apart) gives the
    # values that the colocated run's update took from its own forward
    assert "timing_s/values" in got[1] and "timing_s/values" not in want[1]
    assert sorted(p.name for p in (run_dir / "logs").glob("critic_*.log")) == [
        f"critic_{r}.log" for r in range(2)
    ]
    _assert_steps_equal(want, got, (1, 2))
    for step in (1, 2):  # the same tokens scored by the same critic at PP2 as at PP1
        for a, b in zip(_dump(uninterrupted, step), _dump(run_dir, step)):
            assert a["response_ids"] == b["response_ids"]
            assert b["values"] == pytest.approx(a["values"], **TOL)  # 3e-5 apart seen, on values of -4.5
    ckpts = run_dir / "checkpoints"
    assert {p.name for p in (ckpts / "step_000002" / "critic").iterdir()} == {"model", "optim", "update.pt"}
    assert [p.name for p in ckpts.iterdir()] == ["step_000002"]  # no staging folder left behind
    _run(run_dir, "trainer.total_steps=4")  # resumes with the critic on the actor's ranks (TP1)
    got = metrics_by_step(run_dir)
    _assert_steps_equal(want, got, (3, 4))
    assert [r["response_ids"] for r in _dump(run_dir, 4)] == [
        r["response_ids"] for r in _dump(uninterrupted, 4)
    ]


def _export_critic(ckpt, out) -> list[str]:
    cmd = [
        sys.executable,
        "tools/convert/megatron_to_hf.py",
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
        "--critic",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return cmd


def _assert_dumped_values_are_the_exported_critics(hf_dir, dump_path) -> None:
    """The values a run dumped equal the HF token classifier's logits on the same ids (1e-4)."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert model.config.num_labels == 1 and model.config.architectures[0].endswith("ForTokenClassification")
    for row in [json.loads(line) for line in dump_path.read_text().splitlines()][:2]:
        ids = row["prompt_ids"] + row["response_ids"]
        with torch.no_grad():
            values = model(torch.tensor([ids])).logits[0, :, 0]
        start = len(row["prompt_ids"]) - 1  # the value of the state before the first response token
        torch.testing.assert_close(
            values[start : len(ids) - 1], torch.tensor(row["values"]), rtol=0, atol=1e-4
        )


def test_the_critic_exports_as_an_hf_token_classifier_whose_logits_are_its_values(uninterrupted, tmp_path):
    # step_000002 holds the critic after step 2's update: the one that scored step 3's rollouts.
    cmd = _export_critic(uninterrupted / "checkpoints" / "step_000002", tmp_path / "critic_hf")
    _assert_dumped_values_are_the_exported_critics(
        tmp_path / "critic_hf", uninterrupted / "rollouts" / "step_000003.jsonl"
    )
    # the actor's checkpoint folder of an SFT run has no critic: named, before anything starts
    proc = subprocess.run(
        [*cmd[:3], str(uninterrupted / "sft" / "checkpoint"), "--out", str(tmp_path / "x"), "--critic"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "holds no critic" in proc.stderr, proc.stderr[-2000:]


def test_critic_init_from_starts_the_critic_from_a_checkpoints_critic(uninterrupted, tmp_path):
    ckpt = uninterrupted / "checkpoints" / "step_000004"
    run_dir = tmp_path / "run"
    _run(run_dir, "trainer.total_steps=1", "trainer.critic_warmup=0", f"critic.init_from={ckpt}")
    _export_critic(ckpt, tmp_path / "critic_hf")
    # step 1's values come from step 4's critic, head included (a new head would differ by far)
    _assert_dumped_values_are_the_exported_critics(
        tmp_path / "critic_hf", run_dir / "rollouts" / "step_000001.jsonl"
    )
