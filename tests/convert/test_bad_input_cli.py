"""A user's mistake given to `score` or a converter is refused up front: exit status 2, one message
naming the input, no traceback, within seconds (before torch.distributed or a model starts).

(`train`, `sft` and `rollout`: tests/train/test_bad_input_commands.py.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "convert"
FAST_S = 30.0
"""A refusal takes a second or two; torch.distributed and a Megatron model would take far longer."""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    return env


def _run(cmd: list[str]) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def score(*args: str) -> tuple[int, str, float]:
    """`python -m megatron_agent score ARGS`: (exit status, output, seconds)."""
    return _run([sys.executable, "-m", "megatron_agent", "score", *args])


def tool(script: str, *args: str) -> tuple[int, str, float]:
    """`python tools/convert/SCRIPT ARGS`: (exit status, output, seconds)."""
    return _run([sys.executable, str(TOOLS / script), *args])


def assert_refused(result: tuple[int, str, float], *named: str) -> None:
    """Exit status 2, every string of `named` in the output, no traceback, fast."""
    rc, out, seconds = result
    assert rc == 2, out[-3000:]
    for text in named:
        assert text in out, f"{text!r} not in:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    assert seconds < FAST_S, f"took {seconds:.1f} s: something started before the input was checked"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen2 model (4 heads, 2 kv heads, 4 layers), its converted checkpoint, an altered
    copy of it (one file changed after saving), a folder without config.json, and bad data files."""
    from megatron_agent.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("bad_input_cli")
    model = make_tiny_model(root / "model", "qwen2", seed=3)
    ckpt = root / "ckpt"
    rc, out, _ = tool("hf_to_megatron.py", "--hf", str(model), "--out", str(ckpt))
    assert rc == 0, out[-3000:]
    altered = root / "altered"
    shutil.copytree(ckpt, altered)
    victim = sorted((altered / "model").glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the sha256 tells
    victim.write_bytes(bytes(data))
    (root / "no_config").mkdir()
    (root / "no_config" / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    (root / "empty.jsonl").write_text("")
    (root / "latin1.jsonl").write_bytes(b'{"input_ids": [1, 2]}\n{"input_ids": [3, 4], "note": "caf\xe9"}\n')
    (root / "ok.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    return {
        "root": root,
        "model": model,
        "ckpt": ckpt,
        "altered": altered,
        "victim": victim,
        "no_config": root / "no_config",
        "empty": root / "empty.jsonl",
        "latin1": root / "latin1.jsonl",
        "ok": root / "ok.jsonl",
        "out": root / "out.jsonl",
    }


# ----------------------------------------------------------------------------------- score
def _score_args(w: dict[str, Path], **over: str) -> list[str]:
    args = {"--model": str(w["model"]), "--data": str(w["ok"]), "--out": str(w["out"]), **over}
    return [x for kv in args.items() for x in kv]


@pytest.mark.parametrize("key", ["missing", "no_config"])
def test_score_refuses_a_model_folder_that_is_missing_or_has_no_config(work, key):
    folder = work["root"] / "missing" if key == "missing" else work["no_config"]
    expected = "no such folder" if key == "missing" else "no config.json"
    assert_refused(score(*_score_args(work, **{"--model": str(folder)})), f"--model {folder}", expected)
    assert not work["out"].exists()


def test_score_refuses_sizes_below_one_naming_each_flag(work):
    args = [*_score_args(work), "--tp", "-1", "--pp", "0", "--batch-size", "0", "--max-tokens", "0"]
    assert_refused(score(*args), "--tp -1", "--pp 0", "--batch-size 0", "--max-tokens 0", ">= 1")


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tp", "3"], ["--tp=3", "4 attention heads", "2 key/value heads"]),
        (["--pp", "3"], ["--pp=3", "4 layers"]),
        (
            ["--tp", "2"],
            ["tp*pp=2", "one process (no torchrun)", "torchrun --nproc_per_node 2 -m megatron_agent"],
        ),
    ],
    ids=["tp_heads", "pp_layers", "world_size"],
)
def test_score_refuses_a_layout_the_model_or_the_processes_cannot_hold(work, flags, named):
    assert_refused(score(*_score_args(work), *flags), *named)


@pytest.mark.parametrize(
    "key, named",
    [
        ("empty", ["no rows"]),
        ("latin1", ["line 2", "not UTF-8"]),
        ("missing", ["no such file"]),
    ],
)
def test_score_refuses_bad_data_files_naming_them(work, key, named):
    path = work["root"] / "missing.jsonl" if key == "missing" else work[key]
    assert_refused(score(*_score_args(work, **{"--data": str(path)})), str(path), *named)
    assert not work["out"].exists()


# ----------------------------------------------------------------------------- converters
def test_hf_to_megatron_refuses_a_missing_model_folder(work):
    missing = work["root"] / "missing"
    out = work["root"] / "new_ckpt"
    assert_refused(tool("hf_to_megatron.py", "--hf", str(missing), "--out", str(out)), f"--hf {missing}")
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tp", "-1"], ["--tp -1", ">= 1"]),
        (["--pp", "0"], ["--pp 0", ">= 1"]),
        (["--tp", "3"], ["--tp=3", "4 attention heads"]),
    ],
    ids=["tp_negative", "pp_zero", "tp_heads"],
)
def test_hf_to_megatron_refuses_a_bad_layout(work, flags, named):
    out = work["root"] / "new_ckpt"
    assert_refused(tool("hf_to_megatron.py", "--hf", str(work["model"]), "--out", str(out), *flags), *named)
    assert not out.exists()


def test_hf_to_megatron_refuses_an_existing_output_without_overwrite(work):
    before = sorted(p.name for p in work["ckpt"].rglob("*"))
    result = tool("hf_to_megatron.py", "--hf", str(work["model"]), "--out", str(work["ckpt"]))
    assert_refused(result, f"--out {work['ckpt']} exists", "--overwrite")
    assert sorted(p.name for p in work["ckpt"].rglob("*")) == before


@pytest.mark.parametrize("script", ["megatron_to_hf.py", "verify.py"])
def test_an_altered_checkpoint_file_is_named_before_anything_starts(work, script):
    out = work["root"] / "export"
    args = ["--ckpt", str(work["altered"])]
    args += ["--out", str(out)] if script == "megatron_to_hf.py" else ["--hf", str(work["model"])]
    assert_refused(tool(script, *args), "checkpoint file altered", str(work["victim"]))
    assert not out.exists()


@pytest.mark.parametrize("script", ["megatron_to_hf.py", "verify.py"])
def test_a_missing_checkpoint_is_named(work, script):
    missing = work["root"] / "no_ckpt"
    args = ["--ckpt", str(missing)]
    args += (
        ["--out", str(work["root"] / "export")]
        if script == "megatron_to_hf.py"
        else ["--hf", str(work["model"])]
    )
    assert_refused(tool(script, *args), f"--ckpt {missing}", "no such folder")


def test_debug_prints_the_traceback_of_a_refusal(work):
    rc, out, _ = tool(
        "megatron_to_hf.py", "--ckpt", str(work["altered"]), "--out", str(work["root"] / "export"), "--debug"
    )
    assert rc == 2
    assert "Traceback" in out and "CheckpointIntegrityError" in out
    assert f"error: --ckpt {work['altered']}: checkpoint file altered" in out
