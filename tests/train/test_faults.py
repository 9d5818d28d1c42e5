"""Faults survived (issue 11 point 5) on the real stack: one trainer session with two Megatron
ranks (DP2), a vLLM engine and misbehaving tools, driven step by step from this process.

- Every trajectory's first turn is forced (`debug.forced_first_turn`) to call four tools that
  crash, exit, hang and flood; the run goes on, each failure is a masked error response, counted.
- Step 2's update gets a NaN in the actor's logits at one chosen token (`debug.nan_logits_*`):
  the step is skipped on both ranks, weights and optimizer state stay bitwise unchanged, the
  culprit report names the token, and step 3 updates again.
- Checkpoints go to a small tmpfs (when this process may mount one): the save after step 1 fits,
  the save after step 2 meets a really full disk. `checkpoint.on_save_error=stop` raises naming
  the path, `continue` warns and counts; no staging folder is left and the step-1 checkpoint
  still verifies and loads bitwise.

Tool faults are also checked at the tool-runner level (`ToolSet.run`) without any engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time

import pytest

from megatron_agent.envs.tools import ToolSet
from tests.conftest import REPO, read_dump
from tests.train.faulty_tools import FAULTY, FLOOD_BYTES, TOOL_PATHS, calls_text

NAN_STEP, NAN_SAMPLE, NAN_TOKEN = 2, 1, 3
TOOLS = list(FAULTY)  # crash, exits, hang, flood
TINY = [
    "sft.steps=0",
    "parallel.dp=2",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",  # one optimizer step per RL step
    "actor.lr=1e-3",
    "rollout.n=2",
    "rollout.max_new_tokens=56",
    "rollout.max_turns=2",
    "rollout.stop_at_tool_call=false",  # all four calls in the forced turn
    "tools.max_tool_response_tokens=48",
    "data.num_synthetic_val_tasks=2",
    "logging.plot=false",
    "trainer.worker_timeout_s=180",
    "checkpoint.keep_last=2",
    f"debug.nan_logits_step={NAN_STEP}",
    f"debug.nan_logits_sample={NAN_SAMPLE}",
    f"debug.nan_logits_token={NAN_TOKEN}",
]
TMPFS_BYTES = 18 << 20  # one quickstart checkpoint (about 12 MB at DP2) fits, two do not


def mount_tmpfs(path, size_bytes: int) -> bool:
    """Mount a tmpfs of `size_bytes` at `path` (created); False where this process may not."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], capture_output=True
    )
    return proc.returncode == 0


def umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _task_file(folder):
    from megatron_agent.data.synthetic import arithmetic_tasks
    from megatron_agent.data.tasks import write_tasks

    tasks = arithmetic_tasks(4, seed=5)
    for task in tasks:
        task.tools = TOOLS
        task.reward = {"fn": "tests.train.faulty_tools.spread_reward", "ground_truth": "0"}
    return write_tasks(folder / "train.jsonl", tasks)


@pytest.fixture(scope="module")
def drill(tmp_path_factory, request, repo_on_pythonpath):
    from megatron_agent.config import config_to_dict, load_config
    from megatron_agent.train.checkpointer import SaveError, Saver
    from megatron_agent.train.cluster import ray_cluster
    from megatron_agent.train.rl_loop import rl_step
    from megatron_agent.train.run_log import RunLogger
    from megatron_agent.train.trainer import Trainer
    from tests.train.checked_worker import CheckedMegatronWorker

    root = tmp_path_factory.mktemp("faults")
    run_dir, save_dir = root / "run", root / "ckpt"
    tmpfs = mount_tmpfs(save_dir, TMPFS_BYTES)
    if tmpfs:
        request.addfinalizer(lambda: umount(save_dir))  # also when the session fails
    cfg = load_config(
        REPO / "examples/quickstart/config.yaml",
        [
            *TINY,
            f"trainer.run_dir={run_dir}",
            f"checkpoint.save_dir={save_dir}",
            f"data.train_path={_task_file(root)}",
        ],
    )
    cfg.tools.enabled = ["calculator", *TOOL_PATHS]
    cfg.debug.forced_first_turn = calls_text(TOOLS)
    out = {"run_dir": run_dir, "save_dir": save_dir, "tmpfs": tmpfs, "rows": [], "sums": []}
    t = Trainer(cfg)
    run_log = RunLogger(run_dir, cfg.logging, config_dict=config_to_dict(cfg))
    with ray_cluster(cfg.ray.address, cfg.ray.num_cpus):
        try:
            t.start(actor_cls=CheckedMegatronWorker)
            t.make_update(3)
            t.sync()
            run_log.log(0, {})
            saver = Saver(cfg, t, run_log)
            out["sums"].append(t.actors.call("state_checksum"))
            for step in (1, 2, 3):
                start = time.monotonic()
                row = rl_step(t, step)
                row["wall_s"] = time.monotonic() - start
                run_log.log(step, row)
                out["rows"].append(row)
                out["sums"].append(t.actors.call("state_checksum"))
                if tmpfs and step == 1:
                    out["saved_1"] = saver.save(1)
                if tmpfs and step == 2:  # the disk is full now
                    cfg.checkpoint.on_save_error = "stop"
                    try:
                        saver.save(2)
                    except SaveError as exc:
                        out["stop_error"] = str(exc)
                    out["staging_after_stop"] = sorted(p.name for p in save_dir.iterdir())
                    cfg.checkpoint.on_save_error = "continue"
                    out["continue_result"] = saver.save(2)
                    out["num_errors"] = saver.num_errors
            if tmpfs:
                t.actors.call("load_state", str(out["saved_1"]))
                out["loaded_sums"] = t.actors.call("state_checksum")
                out["listing"] = sorted(p.name for p in save_dir.iterdir())
        finally:
            run_log.close()
            t.close()
    return out


# ------------------------------------------------------------------------------------ NaN logits
def test_nan_logits_skip_the_step_on_all_ranks_and_change_nothing(drill):
    before, after_1, after_2, after_3 = drill["sums"]
    rows = drill["rows"]
    assert [r["guard/skipped"] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["guard/num_nonfinite_tokens"] >= 1
    assert len(after_1) == 2 and after_1[0] == after_1[1]  # two data-parallel replicas, identical
    assert after_1 != before  # step 1 trained
    assert after_2 == after_1  # the skipped step: weights and optimizer state bitwise unchanged
    assert after_3 != after_2  # and the run goes on training


def test_culprit_report_names_the_poisoned_token(drill):
    run_dir = drill["run_dir"]
    reports = sorted((run_dir / "guard").glob("step_*.json"))
    assert len(reports) == 1, reports  # only the poisoned step breached
    report = json.loads(reports[0].read_text())
    assert "nonfinite_tokens" in report["reasons"]
    culprit = report["breaching_tokens"][0]
    traj = read_dump(run_dir, NAN_STEP)[NAN_SAMPLE]
    assert culprit["sample_id"] == traj["uid"]
    assert culprit["position"] == len(traj["prompt_ids"]) - 1 + NAN_TOKEN  # the logits predicting it
    assert culprit["token_id"] == traj["response_ids"][NAN_TOKEN]
    assert culprit["logprob"] == "nan" and culprit["text"]
    assert report["num_breaching_tokens"]["nonfinite_tokens"] == 1  # that token only


# ------------------------------------------------------------------------------------ tools
def test_tool_faults_are_masked_errors_counted_and_the_run_goes_on(drill):
    from transformers import AutoTokenizer

    run_dir = drill["run_dir"]
    tok = AutoTokenizer.from_pretrained(run_dir / "base_model")
    num = 4  # trajectories per step
    for step, row in enumerate(drill["rows"], start=1):
        assert row["tool/calls"] == 4 * num
        assert row["tool/status/error"] == 2 * num  # crash and exits
        assert row["tool/timeouts"] == num and row["tool/truncated"] == num
        assert row["tool/errors"] == 3 * num
        assert row["wall_s"] < 120
        for traj in read_dump(run_dir, step):
            assert [(c["name"], c["status"]) for c in traj["tool_calls"]][:4] == [
                ("crash", "error"),
                ("exits", "error"),
                ("hang", "timeout"),
                ("flood", "truncated"),
            ]
            assert traj["num_turns"] == 2  # it went on to a second turn after the tool turn
            tool_ids = [t for t, s in zip(traj["response_ids"], traj["token_source"]) if s == "tool"]
            masks = [m for m, s in zip(traj["loss_mask"], traj["token_source"]) if s == "tool"]
            assert tool_ids and not any(masks)  # tool output never carries loss
            text = tok.decode(tool_ids)
            for message in (
                "crash failed: bad index",
                "exits failed: exited with status 2",
                "hang timed out after 0.5 s",
            ):
                assert message in text, text
            assert len(tool_ids) <= 4 * 48


def test_tool_runner_masks_every_fault():
    tools = ToolSet([cls() for cls in FAULTY.values()], timeout_s=5.0)

    async def run_all():
        return await asyncio.gather(*(tools.run(name, {}) for name in FAULTY))

    start = time.monotonic()
    results = dict(zip(FAULTY, asyncio.run(run_all())))
    assert time.monotonic() - start < 2.5  # the hanging tool was abandoned at its 0.5 s timeout
    assert results["crash"].status == "error" and "crash failed: bad index" in results["crash"].text
    assert results["exits"].status == "error"  # sys.exit inside a tool no longer ends the loop
    assert results["exits"].text == "Error: exits failed: exited with status 2"
    assert results["hang"].status == "timeout" and "hang timed out after 0.5 s" in results["hang"].text
    assert results["flood"].status == "ok" and len(results["flood"].text) == FLOOD_BYTES  # cut by the loop


# ------------------------------------------------------------------------------------ full disk
def test_full_disk_save_stops_or_continues_and_the_previous_checkpoint_survives(drill):
    from megatron_agent.train.run_state import check_run_checkpoint

    if not drill["tmpfs"]:
        pytest.skip("needs root to mount a small tmpfs (a really full disk)")
    save_dir = drill["save_dir"]
    target = save_dir / "step_000002"
    message = drill.get("stop_error", "")
    assert f"saving the checkpoint of step 2 to {target} failed" in message
    assert "MiB free of 18.0 MiB, less than the" in message and "the disk is full" in message, message
    assert "failed on rank 0" in message and "failed on rank 1" in message  # every rank's reason
    assert f"the newest complete checkpoint is {save_dir / 'step_000001'}" in message
    assert drill["staging_after_stop"] == ["step_000001"]  # staging folder removed
    assert drill["continue_result"] is None and drill["num_errors"] == 2
    assert drill["listing"] == ["step_000001"]
    state = check_run_checkpoint(save_dir / "step_000001")  # every sha256 still matches
    assert state["step"] == 1
    assert drill["loaded_sums"] == drill["sums"][1]  # and it loads back bitwise (both ranks)
