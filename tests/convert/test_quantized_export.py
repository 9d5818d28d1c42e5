"""The quantized export (`megatron_to_hf.py --quantize`) and its check (`verify.py` on a quantized
folder), as a user runs them: a tiny Qwen3 converted with hf_to_megatron.py, exported as NVFP4
and FP8; verify.py passes on both and fails, naming the tensor, when one byte of one quantized
weight is altered; a layout vLLM could not load is refused before any work. The tools run side by
side where they can (most of each run is ModelOpt's import, about 8 s)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "convert"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    return env


def _run_all(cwd: Path, *commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Run the tools side by side (each spends most of its time importing ModelOpt)."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(TOOLS / c[0]), *c[1:]],
            cwd=cwd,
            env=_env(),
            stdout=PIPE,
            stderr=PIPE,
            text=True,
        )
        for c in commands
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


VICTIM = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """(WORK, {run: its process}): ckpt/ (the converted tiny Qwen3), its exports nvfp4/ and fp8/,
    damaged/ (nvfp4/ with one byte of VICTIM's data altered), and verify.py on the three."""
    work = tmp_path_factory.mktemp("quantized_export")
    (convert,) = _run_all(work, ["hf_to_megatron.py", "--hf", str(tiny_models["qwen3"]), "--out", "ckpt"])
    _ok(convert)
    exports = _run_all(
        work, *(["megatron_to_hf.py", "--ckpt", "ckpt", "--out", f, "--quantize", f] for f in FMTS)
    )
    for proc in exports:
        _ok(proc)
    shutil.copytree(work / "nvfp4", work / "damaged")
    path = work / "damaged" / "model.safetensors"
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    begin, _ = json.loads(data[8 : 8 + header_len])[VICTIM]["data_offsets"]
    data[8 + header_len + begin] ^= 0x11  # one e2m1 value in each nibble
    path.write_bytes(bytes(data))
    checked = ("nvfp4", "fp8", "damaged")
    verifies = _run_all(work, *(["verify.py", "--hf", f, "--ckpt", "ckpt"] for f in checked))
    runs = {f"export_{f}": p for f, p in zip(FMTS, exports)} | {
        f"verify_{f}": p for f, p in zip(checked, verifies)
    }
    return work, runs


FMTS = ("nvfp4", "fp8")


@pytest.mark.parametrize("fmt", FMTS)
def test_quantized_export_is_written_and_verify_passes(runs, fmt):
    work, procs = runs
    printed = procs[f"export_{fmt}"].stdout
    assert f"wrote {fmt} from ckpt: {fmt} layout" in printed
    assert f"quantization='{'modelopt_fp4' if fmt == 'nvfp4' else 'fp8'}'" in printed
    names = {p.name for p in (work / fmt).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert not [p for p in work.iterdir() if p.name.startswith(".")], "temporary folders left behind"
    config = json.loads((work / fmt / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == ("modelopt" if fmt == "nvfp4" else "fp8")
    verify = _ok(procs[f"verify_{fmt}"]).stdout
    assert "28 linear" in verify and "PASS" in verify and "fp32 checkpoint" in verify


def test_verify_fails_naming_the_tensor_when_one_quantized_byte_is_altered(runs):
    proc = runs[1]["verify_damaged"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"differs: {VICTIM}: dequantized != fake-quantized" in proc.stdout
    assert "FAIL" in proc.stdout and "1 tensor(s) differ" in proc.stdout


def test_a_layout_vllm_cannot_load_is_refused_before_any_work(tiny_models, tmp_path):
    """The check `megatron_to_hf.py --quantize` runs right after the checkpoint's manifest, before
    exporting anything (an InputError: exit status 2): 64-row k and v would share a 128 x 128 tile."""
    sys.path.insert(0, str(TOOLS))
    from megatron_to_hf import check_quantizable

    from megatron_agent.errors import InputError

    (tmp_path / "hf").mkdir()
    shutil.copy2(tiny_models["qwen2"] / "config.json", tmp_path / "hf" / "config.json")
    check_quantizable(tmp_path, "fp8")
    check_quantizable(tmp_path, "nvfp4")
    with pytest.raises(
        InputError, match=r"--quantize fp8_block128: model.layers.0.self_attn.k_proj.weight: 64 rows"
    ):
        check_quantizable(tmp_path, "fp8_block128")
