"""The converters as a new user runs them: an HF folder without tokenizer files, and --tp/--pp
without torchrun (issue 11, point 6)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "convert"
PY = sys.executable


def _cli(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [PY, str(TOOLS / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory) -> Path:
    """A tiny Qwen2 HF folder with config and weights only (no tokenizer files)."""
    from megatron_agent.models.tiny import make_tiny_model

    work = tmp_path_factory.mktemp("cli_defects")
    make_tiny_model(work / "full", "qwen2", vocab_size=350, seed=3)
    (work / "hf").mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy2(work / "full" / name, work / "hf" / name)
    return work


def test_tp_pp_without_torchrun_converts_in_one_process_and_says_so(no_tokenizer):
    work = no_tokenizer
    proc = _cli("hf_to_megatron.py", "--hf", "hf", "--out", "ckpt", "--tp", "2", "--pp", "2", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "only split the work over torchrun processes" in proc.stderr
    assert "loads at any TP/PP layout" in proc.stderr
    assert "torchrun --nproc_per_node 4 tools/convert/hf_to_megatron.py --hf hf --out ckpt --tp 2 --pp 2" in (
        proc.stderr
    )
    assert "wrote ckpt" in proc.stdout and (work / "ckpt" / "meta.json").is_file()


def test_verify_without_tokenizer_compares_random_ids_and_says_the_text_batch_was_skipped(no_tokenizer):
    work = no_tokenizer
    if not (work / "ckpt" / "meta.json").is_file():
        pytest.skip("needs the checkpoint of the conversion test above")
    proc = _cli("verify.py", "--hf", "hf", "--ckpt", "ckpt", cwd=work)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "text batch skipped" in proc.stdout and "no tokenizer files" in proc.stdout
    rows = [line.split(":")[0].strip() for line in proc.stdout.splitlines() if "max|logit diff|" in line]
    assert rows == ["random"]
    assert "PASS" in proc.stdout
    # A verify layout the processes cannot hold is a usage error that says how to launch it.
    proc = _cli("verify.py", "--hf", "hf", "--ckpt", "ckpt", "--tp", "2", cwd=work)
    assert proc.returncode == 2
    assert "torchrun --nproc_per_node 2 tools/convert/verify.py" in proc.stderr


def test_a_tokenizer_that_gives_no_ids_is_skipped_and_a_working_one_is_used(no_tokenizer):
    sys.path.insert(0, str(TOOLS))
    from verify import usable_tokenizer

    work = no_tokenizer
    config_only = work / "config_only"
    config_only.mkdir(exist_ok=True)
    shutil.copy2(work / "full" / "tokenizer_config.json", config_only)
    folder, why = usable_tokenizer([config_only, work / "hf"], 350)
    assert folder is None
    assert str(config_only) in why and "no tokenizer files" in why
    folder, why = usable_tokenizer([config_only, work / "full"], 350)
    assert folder == work / "full" and why == ""
