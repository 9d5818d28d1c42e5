"""FP8 rollout weights (rollout.fp8, sync.fp8) on CPU: quantize/dequantize bounds, scale shapes,
names, buckets, the FP8 checkpoint folder, the config default and the capability errors."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_agent.rollout.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Quantizer,
    dequantize,
    is_quantized_linear,
    prepare_fp8_engine,
    quantize_blockwise,
    quantize_per_tensor,
    write_fp8_checkpoint,
)
from megatron_agent.sync.buckets import BucketHeader, BucketWriter, first_bad_entry, iter_views, units_nbytes
from megatron_agent.sync.fp8 import fp8_quantizer
from megatron_agent.sync.transports import BucketBuffer, open_bucket

# e4m3: 3 mantissa bits -> rounding to nearest is within 2^-4 of |x| for normal values; below
# the smallest normal (2^-6) the spacing is 2^-9, i.e. an absolute error of at most 2^-10.
REL = 2.0**-4
ABS = 2.0**-10


def _bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w.abs() * REL + scale * ABS


def test_per_tensor_round_trip_is_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 80, generator=g) * 0.02).to(torch.bfloat16)
    q, scale = quantize_per_tensor(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert float(scale) == pytest.approx(float(w.float().abs().max()) / FP8_MAX, rel=1e-6)
    back = dequantize(q, scale)
    err = (back - w.float()).abs()
    assert (err <= _bound(w.float(), scale)).all(), float(err.max())
    # The largest |w| maps onto 448 exactly and comes back exactly.
    i = w.float().abs().argmax()
    assert float(back.flatten()[i]) == pytest.approx(float(w.float().flatten()[i]), rel=1e-6)
    # Quantization is not a no-op: a real error, about 1-2% of the weights' scale on average.
    assert 1e-3 < float((err / w.float().abs().clamp_min(1e-6)).median()) < REL


def test_blockwise_scales_per_tile_and_edge_tiles():
    g = torch.Generator().manual_seed(1)
    n, k = 300, 200  # neither a multiple of 128: edge tiles of 44 rows and 72 columns
    w = torch.randn(n, k, generator=g) * 0.01
    w[:128, :128] *= 1e5  # one tile of large values must not cost the others their precision
    q, scale_inv = quantize_blockwise(w)
    assert q.dtype == FP8_DTYPE and q.shape == (n, k)
    assert scale_inv.shape == (3, 2) and scale_inv.dtype == torch.float32
    tile_amax = torch.stack(
        [
            torch.stack([w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max() for j in range(2)])
            for i in range(3)
        ]
    )
    assert torch.allclose(scale_inv, tile_amax / FP8_MAX, rtol=1e-6)
    back = dequantize(q, scale_inv)
    full_scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    assert ((back - w).abs() <= _bound(w, full_scale)).all()
    # Per-tensor scaling of the same weight flushes the small tiles below e4m3's range.
    q1, s1 = quantize_per_tensor(w)
    small = (slice(128, n), slice(0, k))
    err_block = (back - w)[small].abs().mean()
    err_tensor = (dequantize(q1, s1) - w)[small].abs().mean()
    assert err_block * 10 < err_tensor


def test_zero_and_bf16_inputs():
    q, s = quantize_per_tensor(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert float(s) == 1.0 and (q.float() == 0).all()
    q, s = quantize_blockwise(torch.zeros(130, 5))
    assert s.shape == (2, 1) and (s == 1).all() and (q.float() == 0).all()
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.zeros(3))


def test_names_follow_vllm_fp8_checkpoints():
    linear = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.11.mlp.gate_proj.weight",
        "model.layers.11.mlp.down_proj.weight",
    ]
    kept = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.q_norm.weight",
    ]
    assert all(is_quantized_linear(n) for n in linear)
    assert not any(is_quantized_linear(n) for n in kept)
    w = torch.randn(256, 128)
    tensor = Fp8Quantizer("tensor").quantize(linear[0], w)
    assert [n for n, _ in tensor] == [linear[0], "model.layers.0.self_attn.q_proj.weight_scale"]
    block = Fp8Quantizer("block128").quantize(linear[0], w)
    assert [n for n, _ in block] == [linear[0], "model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert block[1][1].shape == (2, 1)
    bias = torch.randn(256)
    assert Fp8Quantizer().quantize(kept[4], bias) == [(kept[4], bias)]
    assert Fp8Quantizer("block128").quantization_config() == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    with pytest.raises(ValueError, match="fp8_scales"):
        Fp8Quantizer("channel")


def test_quantized_unit_travels_bit_exactly_in_a_bf16_bucket():
    g = torch.Generator().manual_seed(2)
    unit = [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 32, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(64, generator=g)),
        ("model.layers.0.self_attn.k_proj.weight", torch.randn(32, 32, generator=g)),
    ]
    quantized = Fp8Quantizer("tensor").quantize_unit(unit)
    assert [t.dtype for _, t in quantized] == [
        FP8_DTYPE,
        torch.float32,
        torch.float32,
        FP8_DTYPE,
        torch.float32,
    ]
    buf = BucketBuffer(units_nbytes(quantized, torch.bfloat16), shared=False, device="cpu")
    header = BucketHeader(sync_id=1, sender=0, index=0, algo="crc32")
    writer = BucketWriter(buf.u8, header, torch.bfloat16)
    for name, t in quantized:
        writer.add(name, t)
    assert not writer.fits(1)
    got = dict(iter_views(open_bucket(buf.payload("direct", header.nbytes)), header))
    for name, t in quantized:
        if name.endswith("bias"):  # not quantized: travels in the rollout dtype
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16))
        else:  # FP8 weights and fp32 scales keep their dtype, bit for bit
            assert got[name].dtype == t.dtype and torch.equal(
                got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
            )
    assert first_bad_entry(buf.u8, header) is None
    buf.u8[header.entries[0].offset] ^= 0x01  # one flipped bit in the first FP8 weight
    bad = first_bad_entry(buf.u8, header)
    assert bad is not None and bad[0].name == "model.layers.0.self_attn.q_proj.weight"


def test_fp8_checkpoint_folder(tiny_models, tmp_path):
    from safetensors import safe_open

    src = tiny_models["qwen2"]
    dst = write_fp8_checkpoint(src, tmp_path / "fp8", "tensor")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert (dst / "tokenizer.json").is_file()
    with (
        safe_open(str(src / "model.safetensors"), "pt") as f_src,
        safe_open(str(dst / "model.safetensors"), "pt") as f_dst,
    ):
        names = set(f_dst.keys())
        linear = [n for n in f_src.keys() if is_quantized_linear(n)]
        assert len(linear) == 7 * config["num_hidden_layers"]
        for n in f_src.keys():
            assert n in names
            if n in linear:
                q, s = f_dst.get_tensor(n), f_dst.get_tensor(n.removesuffix("weight") + "weight_scale")
                assert q.dtype == FP8_DTYPE and s.shape == ()
                w = f_src.get_tensor(n).to(torch.bfloat16).float()
                assert ((dequantize(q, s) - w).abs() <= _bound(w, s)).all()
            else:
                assert f_dst.get_tensor(n).dtype == torch.bfloat16
        assert len(names) == len(set(f_src.keys())) + len(linear)
    mtime = (dst / "model.safetensors").stat().st_mtime_ns
    assert write_fp8_checkpoint(src, dst, "tensor") == dst  # reused, not rewritten
    assert (dst / "model.safetensors").stat().st_mtime_ns == mtime


def test_engine_format_reaches_the_sender():
    assert fp8_quantizer([{"quantization": None}, {}]) is None
    q = fp8_quantizer([{"quantization": {"method": "fp8", "scales": "block128"}}] * 2)
    assert q == Fp8Quantizer("block128")
    with pytest.raises(ValueError, match="different weight formats"):
        fp8_quantizer([{"quantization": None}, {"quantization": {"method": "fp8", "scales": "tensor"}}])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_fp8_rollout_without_a_gpu_is_an_error_naming_it(tiny_models, tmp_path):
    from megatron_agent.config import load_config
    from megatron_agent.rollout.engine import VLLMEngine
    from megatron_agent.rollout.factory import build_engine

    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        prepare_fp8_engine(tiny_models["qwen2"], "fp8", "tensor", "bfloat16", str(tmp_path))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        VLLMEngine(tiny_models["qwen2"], dtype="bfloat16", quantization="fp8", cache_dir=str(tmp_path))
    cfg = load_config(None, ["rollout.quantization=fp8", "model.dtype=bf16"], validate=False)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        build_engine(cfg, str(tiny_models["qwen2"]), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        prepare_fp8_engine(tiny_models["qwen2"], "fp8", "tensor", "float32", str(tmp_path))
    with pytest.raises(ValueError, match="choose one of"):
        prepare_fp8_engine(tiny_models["qwen2"], "int4", "tensor", "bfloat16", str(tmp_path))
    assert not any(tmp_path.iterdir())  # nothing was converted before the checks


def test_fp8_rollout_turns_truncated_is_on_unless_set(tmp_path):
    from megatron_agent.config import load_config, make_plan

    def level(*overrides, path=None):  # the derived value lives in the run's plan
        return make_plan(load_config(path, list(overrides), validate=False)).rollout_is

    assert level() == "none"
    assert level("rollout.quantization=fp8") == "token"
    assert level("rollout.quantization=fp8", "algorithm.rollout_is=none") == "none"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("rollout:\n  quantization: fp8\nalgorithm:\n  rollout_is: sequence\n")
    assert level(path=yaml_file) == "sequence"
