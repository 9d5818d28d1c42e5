"""ModelOpt's quantization of one weight (megatron_agent/quant/ops.py, formats.py) against ModelOpt
itself: its fake quantizer on an HF model, its quantized-tensor classes, the e2m1 grid, shards."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from megatron_agent.quant.formats import FORMATS, is_quantized_linear, rollout_format
from megatron_agent.quant.ops import dequantize, fake_quantize, layout_bytes, quantize

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.fixture(scope="module")
def mtq():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
    return mtq


def _weights(shape=(320, 192), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.05


def test_fp8_is_modelopts_quantization_of_an_hf_model(mtq, tiny_models):
    """`mtq.quantize(model, FP8_DEFAULT_CFG)` on the HF model (fp32) quantizes exactly the tensors
    `is_quantized_linear` names. `fake_quantize` is ModelOpt's `FP8QTensor` quantize-dequantize bit
    for bit; its calibrated fake-quant modules compute the same values to within two fp32 ulps
    (they scale by 448 / amax where the quantized tensor divides by amax / 448)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["qwen2"]), dtype=torch.float32)
    quantized = copy.deepcopy(model)
    mtq.quantize(quantized, mtq.FP8_DEFAULT_CFG, forward_loop=None)
    names = [
        f"{name}.weight"
        for name, module in quantized.named_modules()
        if getattr(module, "weight_quantizer", None) is not None and module.weight_quantizer.is_enabled
    ]
    assert names and names == [n for n, _ in model.named_parameters() if is_quantized_linear(n)]
    for name in names:
        module = quantized.get_submodule(name.removesuffix(".weight"))
        weight = model.get_parameter(name).detach()
        ours = fake_quantize(FORMATS["fp8"], weight)
        q, scale = FP8QTensor.quantize(weight)
        assert torch.equal(ours, q.dequantize(dtype=torch.float32, scale=scale)), name
        theirs = module.weight_quantizer(module.weight).detach()
        torch.testing.assert_close(ours, theirs, rtol=2.4e-7, atol=0)  # two ulps
        assert not torch.equal(ours, weight)  # it did quantize


def test_fp8_block_is_modelopts_quantized_tensor_and_within_rounding_of_its_fake_quantizer(mtq):
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.qtensor import FP8QTensor

    w = _weights((300, 200))  # edge tiles of 44 rows and 72 columns
    w[:128, :128] *= 1e3  # one large tile must not cost the others their precision
    fmt = FORMATS["fp8_block128"]
    qw = quantize(fmt, w)
    assert qw.data.dtype == torch.float8_e4m3fn and qw.scales["weight_scale_inv"].shape == (3, 2)
    sizes = {-1: 128, -2: 128}
    q, s = FP8QTensor.quantize(w, block_sizes=sizes)
    assert torch.equal(
        dequantize(fmt, qw), q.dequantize(dtype=torch.float32, scale=s, block_sizes=sizes)[:300, :200]
    )
    weight_cfg = next(
        e["cfg"]
        for e in mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG["quant_cfg"]
        if e.get("quantizer_name") == "*weight_quantizer"
    )
    theirs = TensorQuantizer(QuantizerAttributeConfig(**weight_cfg))(w)
    torch.testing.assert_close(fake_quantize(fmt, w), theirs, rtol=1e-6, atol=0)
    small = (fake_quantize(fmt, w) - w)[128:, 128:].abs().max()
    assert small <= 2**-4 * w[128:, 128:].abs().max()  # the small tiles keep e4m3's relative precision


def test_nvfp4_values_lie_on_the_e2m1_grid_of_their_block_scales():
    fmt = FORMATS["nvfp4"]
    w = _weights()
    qw = quantize(fmt, w)
    assert qw.data.dtype == torch.uint8 and qw.data.shape == (320, 96)  # two e2m1 per byte
    block, second = qw.scales["weight_scale"], qw.scales["weight_scale_2"]
    assert block.dtype == torch.float8_e4m3fn and block.shape == (320, 12) and second.shape == ()
    assert float(second) == pytest.approx(float(w.abs().max()) / (6 * 448), rel=1e-6)
    scale = (block.float() * second).repeat_interleave(16, dim=1)
    codes = dequantize(fmt, qw) / scale
    on_grid = (codes.abs().unsqueeze(-1) - E2M1_GRID).abs().min(-1).values
    assert float(on_grid.max()) < 1e-5
    err = (fake_quantize(fmt, w) - w).abs()
    assert float(err.max()) <= float(scale.max()) and float(err.mean()) > 1e-4  # it quantized


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_a_shard_with_the_whole_tensors_amax_quantizes_as_the_whole_tensor(name):
    fmt, w = FORMATS[name], _weights((256, 192))
    whole, amax = fake_quantize(fmt, w), w.abs().amax()
    rows = torch.cat([fake_quantize(fmt, part, global_amax=amax) for part in w.chunk(4, dim=0)])
    cols = torch.cat([fake_quantize(fmt, part, global_amax=amax) for part in w.chunk(2, dim=1)], dim=1)
    assert torch.equal(rows, whole) and torch.equal(cols, whole)
    own = torch.cat([fake_quantize(fmt, part) for part in w.chunk(2, dim=1)], dim=1)
    assert not torch.equal(own, whole)  # without the global amax a shard quantizes differently


@pytest.mark.parametrize("name", list(FORMATS))
def test_zeros_and_bf16_weights(name):
    fmt = FORMATS[name]
    assert torch.equal(fake_quantize(fmt, torch.zeros(64, 128)), torch.zeros(64, 128))  # not NaN
    w = _weights((128, 128)).to(torch.bfloat16)
    out = fake_quantize(fmt, w)
    assert out.dtype == torch.bfloat16 and torch.equal(out, fake_quantize(fmt, w.float()).to(torch.bfloat16))


def test_bytes_per_weight_against_bf16():
    w = _weights((1024, 1024))
    bf16 = w.numel() * 2
    ratios = {name: layout_bytes(quantize(fmt, w)) / bf16 for name, fmt in FORMATS.items()}
    assert ratios["fp8"] == pytest.approx(0.5, abs=1e-4)
    assert ratios["fp8_block128"] == pytest.approx(0.5 + 64 * 4 / bf16, abs=1e-6)
    assert ratios["nvfp4"] == pytest.approx((0.5 + 1 / 16) / 2, abs=1e-4)  # 0.28
    for name, fmt in FORMATS.items():
        assert fmt.bytes_per_weight() / 2 == pytest.approx(ratios[name], rel=1e-3)


def test_rollout_quantization_names_their_formats():
    assert rollout_format("") == (None, False)
    assert rollout_format("fp8") == (FORMATS["fp8"], False)
    assert rollout_format("fp8_qdq", "block128") == (FORMATS["fp8_block128"], True)
    assert rollout_format("nvfp4_w4a16") == (FORMATS["nvfp4"], False)
    assert rollout_format("nvfp4_qdq") == (FORMATS["nvfp4"], True)
