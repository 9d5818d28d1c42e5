"""Bad input gets an error that names what was wrong: score lines, checkpoints, configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_agent.commands.score import ScoreInputError, read_inputs
from megatron_agent.models.hf_config import UnsupportedModelError, arch_from_hf_config, load_hf_config
from megatron_agent.weights.hf_io import HFCheckpointReader
from megatron_agent.weights.load import CheckpointMismatchError, check_checkpoint_names


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"ids": [1, 2]}, "line 2: missing field 'input_ids'"),
        ({"input_ids": [1, 400]}, "line 2: token id 400 is outside the vocabulary [0, 400)"),
        ({"input_ids": [1, -1]}, "line 2: token id -1 is outside the vocabulary"),
        (
            {"input_ids": list(range(10)) * 60},
            "line 2: 600 tokens exceed the model's max_position_embeddings=512",
        ),
        ({"input_ids": [1, "2"]}, "line 2: 'input_ids' must be a list of ints"),
        ("{not json", "line 2: not valid JSON"),
    ],
)
def test_score_input_errors_name_the_line(tmp_path, bad_row, message):
    path = write_lines(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3]}, bad_row, {"input_ids": [4, 5]}])
    with pytest.raises(ScoreInputError) as err:
        read_inputs(path, vocab_size=400, max_length=512)
    assert message in str(err.value)


def run_score(model, data, out) -> subprocess.CompletedProcess:
    """`python -m megatron_agent score` on one rank."""
    cmd = [sys.executable, "-m", "megatron_agent", "score", "--model", str(model), "--data", str(data)]
    return subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, timeout=300)


def test_score_command_reports_bad_line_and_writes_nothing(tmp_path, tiny_models):
    data = write_lines(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 999]}])
    out = tmp_path / "out.jsonl"
    proc = run_score(tiny_models["qwen2"], data, out)
    assert proc.returncode == 2
    assert "line 2: token id 999 is outside the vocabulary" in proc.stderr
    assert not out.exists()


def test_score_command_single_rank_matches_shapes(tmp_path, tiny_models):
    rows = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9]}, {"input_ids": [1, 2]}]
    data = write_lines(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    proc = run_score(tiny_models["qwen2"], data, out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    assert [len(r) for r in result] == [3, 0, 1]
    assert all(v < 0 for r in result for v in r)


def copy_model(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(tmp_path, tiny_models):
    path = copy_model(tiny_models["qwen2"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, path / "model.safetensors")
    arch = arch_from_hf_config(load_hf_config(path))
    with HFCheckpointReader(path) as reader, pytest.raises(CheckpointMismatchError) as err:
        check_checkpoint_names(reader, arch)
    assert "missing tensors: model.layers.1.self_attn.k_proj.bias" in str(err.value)


def test_unexpected_tensor_is_named(tmp_path, tiny_models):
    path = copy_model(tiny_models["qwen3"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    arch = arch_from_hf_config(load_hf_config(path))
    with HFCheckpointReader(path) as reader, pytest.raises(CheckpointMismatchError) as err:
        check_checkpoint_names(reader, arch)
    assert "unexpected tensors: model.layers.0.mlp.extra.weight" in str(err.value)


def test_unsupported_architecture_and_rope_are_errors(tiny_models):
    cfg = load_hf_config(tiny_models["qwen2"])
    with pytest.raises(
        UnsupportedModelError, match=r"architectures=\['MistralForCausalLM'\] is not supported; supported: \["
    ):
        arch_from_hf_config(dict(cfg, architectures=["MistralForCausalLM"]))
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'yarn' is not supported"):
        arch_from_hf_config(
            dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None)
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_fp8_and_te_on_cpu_are_clear_errors(tiny_models):
    from megatron_agent.models.build import BuildOptions, transformer_config

    arch = arch_from_hf_config(load_hf_config(tiny_models["qwen2"]))
    with pytest.raises(ValueError, match="model.fp8 needs Transformer Engine on a GPU"):
        transformer_config(arch, BuildOptions(fp8="tensorwise"))
    with pytest.raises(ValueError, match="transformer_impl=te needs Transformer Engine and a CUDA GPU"):
        transformer_config(arch, BuildOptions(transformer_impl="te"))
    with pytest.raises(ValueError, match="model.fp8='e5m2'"):
        transformer_config(arch, BuildOptions(fp8="e5m2", transformer_impl="local"))
