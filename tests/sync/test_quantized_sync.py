"""Quantized rollout weights on the sync side (sync/quantizer.py, rollout/quantized.py): units
quantized by ModelOpt in each format, their trip through a bf16 bucket, the engine's format
reaching the sender, the probe's tolerance, the capability errors and the config's effects.
The bit-exact comparison with ModelOpt through the whole sync is tests/quant/test_qat_sync.py."""

from __future__ import annotations

import pytest
import torch

from megatron_agent.config import SyncConfig
from megatron_agent.quant.formats import FORMATS
from megatron_agent.quant.ops import fake_quantize
from megatron_agent.rollout.quantized import prepare_quantized_engine
from megatron_agent.sync.buckets import BucketHeader, BucketWriter, first_bad_entry, iter_views, units_nbytes
from megatron_agent.sync.quantizer import RolloutQuantizer, quantized_probe_tolerance, rollout_quantizer
from megatron_agent.sync.transports import BucketBuffer, open_bucket


def _unit():
    g = torch.Generator().manual_seed(2)
    return [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 32, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(64, generator=g)),
        ("model.layers.0.self_attn.k_proj.weight", torch.randn(32, 32, generator=g)),
        ("model.layers.0.self_attn.v_proj.weight", torch.randn(32, 32, generator=g) * 3),
    ]


@pytest.mark.parametrize(
    "fmt, dtypes",
    [
        ("fp8", [torch.float8_e4m3fn, torch.float32]),
        ("fp8_block128", [torch.float8_e4m3fn, torch.float32]),
        ("nvfp4", [torch.uint8, torch.float8_e4m3fn, torch.float32]),
    ],
)
def test_a_quantized_unit_travels_bit_exactly_in_a_bf16_bucket(fmt, dtypes):
    quantized = RolloutQuantizer(fmt, FORMATS[fmt], qdq=False).quantize_unit(_unit())
    names = [n for n, _ in quantized]
    scales = [f"model.layers.0.self_attn.{p}_proj.{s}" for p in "qkv" for s in FORMATS[fmt].scale_suffixes]
    assert set(names) == {n for n, _ in _unit()} | set(scales)
    weight_dtypes = [
        t.dtype for n, t in quantized if n.startswith("model.layers.0.self_attn.q_proj.") and "bias" not in n
    ]
    assert weight_dtypes == dtypes
    buf = BucketBuffer(units_nbytes(quantized, torch.bfloat16), shared=False, device="cpu")
    header = BucketHeader(sync_id=1, sender=0, index=0, algo="crc32")
    writer = BucketWriter(buf.u8, header, torch.bfloat16)
    for name, t in quantized:
        writer.add(name, t)
    got = dict(iter_views(open_bucket(buf.payload("direct", header.nbytes)), header))
    for name, t in quantized:
        if name.endswith("bias"):  # not quantized: travels in the rollout dtype
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16))
        else:  # quantized weights and their scales keep their dtype, bit for bit
            assert got[name].dtype == t.dtype and torch.equal(
                got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
            )
    assert first_bad_entry(buf.u8, header) is None
    buf.u8[header.entries[0].offset] ^= 0x01  # one flipped bit in the first quantized weight
    bad = first_bad_entry(buf.u8, header)
    assert bad is not None and bad[0].name == "model.layers.0.self_attn.q_proj.weight"


def test_a_qdq_unit_is_modelopts_values_in_the_same_names():
    unit = _unit()
    got = RolloutQuantizer("nvfp4_qdq", FORMATS["nvfp4"], qdq=True).quantize_unit(unit)
    assert [n for n, _ in got] == [n for n, _ in unit]
    # NVFP4: q, k and v (one fused layer in vLLM) share the second-level scale of their common amax
    amax = torch.stack([t.abs().amax() for n, t in unit if n.endswith("weight")]).amax()
    assert float(amax) == float(unit[3][1].abs().amax())  # v's, the largest
    for i in (0, 2, 3):
        assert torch.equal(got[i][1], fake_quantize(FORMATS["nvfp4"], unit[i][1], global_amax=amax))
    assert not torch.equal(got[0][1], fake_quantize(FORMATS["nvfp4"], unit[0][1]))
    assert torch.equal(got[1][1], unit[1][1])  # the bias stays
    fp8 = RolloutQuantizer("fp8_qdq", FORMATS["fp8"], qdq=True).quantize_unit(unit)  # FP8: each its own
    assert torch.equal(fp8[0][1], fake_quantize(FORMATS["fp8"], unit[0][1]))


def test_the_engines_format_reaches_the_sender():
    assert rollout_quantizer([{"quantization": None}, {}]) is None
    info = {"quantization": {"quantization": "fp8_qdq", "format": "fp8_block128"}}
    assert rollout_quantizer([info] * 2) == RolloutQuantizer("fp8_qdq", FORMATS["fp8_block128"], qdq=True)
    with pytest.raises(ValueError, match="different weight formats"):
        rollout_quantizer([{"quantization": None}, info])
    with pytest.raises(ValueError, match="unknown to the weight sync"):
        rollout_quantizer([{"quantization": {"method": "fp8", "scales": "tensor"}}])


class _Model:
    qat_format = None


def test_the_probe_holds_the_dtype_tolerance_only_when_the_actor_is_quantized_alike():
    cfg, model = SyncConfig(), _Model()
    tols = {"fp8_tol": cfg.probe_tol_fp8, "nvfp4_tol": cfg.probe_tol_nvfp4}
    nvfp4_qdq = RolloutQuantizer("nvfp4_qdq", FORMATS["nvfp4"], qdq=True)
    assert quantized_probe_tolerance(nvfp4_qdq, model, 1e-4, **tols) == cfg.probe_tol_nvfp4
    model.qat_format = FORMATS["nvfp4"]
    assert quantized_probe_tolerance(nvfp4_qdq, model, 1e-4, **tols) == 1e-4
    real = RolloutQuantizer(
        "nvfp4_w4a16", FORMATS["nvfp4"], qdq=False
    )  # quantized kernels: not the same math
    assert quantized_probe_tolerance(real, model, 1e-4, **tols) == cfg.probe_tol_nvfp4
    fp8 = RolloutQuantizer("fp8_qdq", FORMATS["fp8"], qdq=True)
    assert quantized_probe_tolerance(fp8, model, 1e-4, **tols) == cfg.probe_tol_fp8
    model.probe_format = FORMATS["fp8"]  # a qdq run without QAT: the probe's forward is quantized
    assert quantized_probe_tolerance(fp8, model, 1e-4, **tols) == 1e-4


def test_a_qdq_engine_starts_from_the_models_own_folder(tiny_models, tmp_path):
    folder, info, vllm_quantization = prepare_quantized_engine(
        tiny_models["qwen2"], "nvfp4_qdq", "tensor", "float32", str(tmp_path)
    )
    assert folder == tiny_models["qwen2"] and vllm_quantization is None
    assert info == {"quantization": "nvfp4_qdq", "format": "nvfp4"}
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("quantization", ["fp8", "nvfp4_w4a16"])
def test_real_quantized_rollout_without_a_gpu_is_an_error_naming_it(tiny_models, tmp_path, quantization):
    from megatron_agent.config import load_config
    from megatron_agent.rollout.engine import VLLMEngine
    from megatron_agent.rollout.factory import build_engine

    with pytest.raises(ValueError, match=f"needs a CUDA GPU.*{quantization.split('_')[0]}_qdq"):
        prepare_quantized_engine(tiny_models["qwen2"], quantization, "tensor", "bfloat16", str(tmp_path))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        VLLMEngine(tiny_models["qwen2"], dtype="bfloat16", quantization=quantization, cache_dir=str(tmp_path))
    cfg = load_config(None, [f"rollout.quantization={quantization}", "model.dtype=bf16"], validate=False)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        build_engine(cfg, str(tiny_models["qwen2"]), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        prepare_quantized_engine(tiny_models["qwen2"], quantization, "tensor", "float32", str(tmp_path))
    with pytest.raises(ValueError, match="choose one of"):
        prepare_quantized_engine(tiny_models["qwen2"], "int4", "tensor", "bfloat16", str(tmp_path))
    assert not any(tmp_path.iterdir())  # nothing was converted before the checks


def test_quantized_rollout_turns_truncated_is_on_unless_set(tmp_path):
    from megatron_agent.config import load_config, make_plan

    def level(*overrides, path=None):  # the derived value lives in the run's plan
        return make_plan(load_config(path, list(overrides), validate=False)).rollout_is

    assert level() == "none"
    assert level("rollout.quantization=fp8") == "token"
    assert level("rollout.quantization=nvfp4_qdq") == "token"
    assert level("rollout.quantization=fp8", "algorithm.rollout_is=none") == "none"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("rollout:\n  quantization: nvfp4_qdq\nalgorithm:\n  rollout_is: sequence\n")
    assert level(path=yaml_file) == "sequence"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.qat=fp8"], "actor.qat=fp8 needs a rollout quantized alike"),
        (["actor.qat=nvfp4_w4a16", "rollout.quantization=fp8_qdq"], "set rollout.quantization to nvfp4_qdq"),
    ],
)
def test_qat_without_a_rollout_quantized_alike_is_refused_by_name(overrides, message):
    from megatron_agent.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
