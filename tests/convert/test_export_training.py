"""Export after training (issue 11, point 6): a checkpoint written by `train` at TP2 becomes an HF
folder whose log-probs under HF transformers equal the trainer's, and that `rollout` evaluates.

One training run (`python -m megatron_agent train`, tiny quickstart model, 2 SFT steps so that the
weights move, 2 RL steps at TP2, a checkpoint after each step) feeds every test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, TINY_SFT_RL, quickstart_train_cmd, run_torchrun

TOOL = REPO / "tools" / "convert" / "megatron_to_hf.py"
TRAIN = [
    *TINY_SFT_RL,
    "trainer.total_steps=2",
    "trainer.test_freq=0",
    "checkpoint.save_freq=1",
    "logging.plot=false",
    "parallel.tp=2",
]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _ok(proc):
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _export(ckpt, out, *extra):
    cmd = [sys.executable, str(TOOL), "--ckpt", str(ckpt), "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run folder, HF export of the run folder, export's output)."""
    work = tmp_path_factory.mktemp("export_training")
    run_dir = work / "run"
    cmd = quickstart_train_cmd(run_dir, *TRAIN)
    _ok(subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900))
    proc = _ok(_export(run_dir, work / "hf"))  # the run folder: its newest complete checkpoint
    return run_dir, work / "hf", proc


def test_export_of_the_run_folder_takes_its_newest_checkpoint_with_config_and_tokenizer(trained):
    run_dir, hf, proc = trained
    newest = run_dir / "checkpoints" / "step_000002"
    assert json.loads((newest / "meta.json").read_text())["saved_layout"]["tp"] == 2
    assert f"exporting {newest}" in proc.stderr and f"from {newest}" in proc.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (hf / name).is_file(), name
    base = run_dir / "base_model"
    assert (hf / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert not any(p.name in ("optim", "trainer") for p in hf.iterdir())
    from safetensors.torch import load_file

    exported, original = load_file(hf / "model.safetensors"), load_file(base / "model.safetensors")
    assert exported.keys() == original.keys()
    assert exported["model.embed_tokens.weight"].shape[0] == 640  # vocabulary padding dropped (768 at TP2)
    changed = [k for k in exported if not torch.equal(exported[k], original[k])]
    assert len(changed) > len(exported) // 2  # trained weights, not the base model's


def test_hf_logprobs_equal_the_trainers_from_the_checkpoint(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, hf, _ = trained
    ckpt = run_dir / "checkpoints" / "step_000002"
    tok = AutoTokenizer.from_pretrained(hf)
    dump = [
        json.loads(line) for line in (run_dir / "rollouts" / "step_000002.jsonl").read_text().splitlines()
    ]
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}], tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(0)
    sequences = [
        dump[0]["prompt_ids"] + dump[0]["response_ids"],  # a trajectory of the last RL step
        prompt,
        torch.randint(0, 640, (40,), generator=gen).tolist(),
    ]
    (tmp_path / "in.json").write_text(json.dumps(sequences))
    run_torchrun(
        [
            "tests/convert/export_score.py",
            str(ckpt),
            str(tmp_path / "in.json"),
            str(tmp_path / "out.json"),
            "--tp",
            "2",
        ],
        nproc=2,
    )
    trainer_lps = json.loads((tmp_path / "out.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    worst = 0.0
    for ids, theirs in zip(sequences, trainer_lps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        hf_lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert len(theirs) == len(ids) - 1
        worst = max(worst, (hf_lp - torch.tensor(theirs)).abs().max().item())
    assert worst <= 1e-4, worst


def test_rollout_command_evaluates_the_exported_folder(trained, tmp_path):
    _, hf, _ = trained
    eval_dir = tmp_path / "eval"
    cmd = [
        sys.executable,
        "-m",
        "megatron_agent",
        "rollout",
        "--config",
        "examples/quickstart/config.yaml",
        "--model",
        str(hf),
        "--run-dir",
        str(eval_dir),
        "rollout.n=2",
        "rollout.max_new_tokens=16",
        "data.num_synthetic_tasks=2",
    ]
    proc = _ok(subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600))
    assert "critic/score/mean" in proc.stdout and "rollout dump:" in proc.stdout
    metrics = json.loads((eval_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["rollout/num_trajectories"] == 4
    assert len((eval_dir / "rollouts" / "step_000000.jsonl").read_text().splitlines()) == 4


def test_an_altered_newest_checkpoint_is_skipped_and_the_previous_one_exported(trained, tmp_path):
    run_dir, _, _ = trained
    root = tmp_path / "checkpoints"  # a checkpoint.save_dir-style folder of step_N checkpoints
    for name in ("step_000001", "step_000002"):
        shutil.copytree(run_dir / "checkpoints" / name, root / name)
    bad = next((root / "step_000002" / "model").glob("*.distcp"))
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    proc = _ok(_export(root, tmp_path / "hf"))
    assert f"skipping {root / 'step_000002'}: checkpoint file altered: {bad}" in proc.stderr
    assert f"from {root / 'step_000001'}" in proc.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _export(empty, tmp_path / "hf2")
    assert proc.returncode == 2 and "no step_N folders" in proc.stderr
    assert not (tmp_path / "hf2").exists()
