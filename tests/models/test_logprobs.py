"""The chunked vocab-parallel log-prob and entropy match a naive full-vocabulary computation.

The reference is the naive path in float64: logits over the real vocabulary, log_softmax, gather
the target, entropy = -sum p log p, autograd for the gradients. Ours runs in fp32 (or from bf16
inputs), chunked, with vocabulary padding, and at TP=2 and TP=4 over real gloo ranks.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_agent.models import logprobs
from megatron_agent.models.logprobs import fused_head_logprobs, vocab_parallel_logprobs, vocab_range

NUM_TOKENS, HIDDEN, PADDED_VOCAB, TRUE_VOCAB = 37, 16, 64, 45
FP32_TOL = dict(rtol=1e-6, atol=1e-5)


def _make_inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    """hidden [T, H], weight [V_padded, H] (padded rows huge, to catch leaks), targets, upstream grads."""
    gen = torch.Generator().manual_seed(seed)
    hidden_TH = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)
    weight_VH = torch.randn(PADDED_VOCAB, HIDDEN, generator=gen) * 0.7
    weight_VH[TRUE_VOCAB:] = 50.0  # padding rows: logits far above every real one
    target_T = torch.randint(0, TRUE_VOCAB, (NUM_TOKENS,), generator=gen)
    target_T[:3] = torch.tensor([0, TRUE_VOCAB - 1, TRUE_VOCAB // 2])
    g_logp_T = torch.randn(NUM_TOKENS, generator=gen)
    g_ent_T = torch.randn(NUM_TOKENS, generator=gen)
    return hidden_TH.to(dtype), weight_VH.to(dtype), target_T, g_logp_T, g_ent_T


def _naive(logits_TV: torch.Tensor, target_T: torch.Tensor):
    """Full-vocabulary log_softmax over the real rows; float64 unless given otherwise."""
    logp_TV = torch.log_softmax(logits_TV[:, :TRUE_VOCAB], dim=-1)
    logp_T = logp_TV.gather(1, target_T.unsqueeze(1)).squeeze(1)
    return logp_T, -(logp_TV.exp() * logp_TV).sum(-1)


def _naive_head(hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T):
    """Naive values and gradients (hidden, weight, logits) in float64."""
    hidden = hidden_TH.detach().double().requires_grad_()
    weight = weight_VH.detach().double().requires_grad_()
    logits = hidden @ weight.t()
    logits.retain_grad()
    logp_T, ent_T = _naive(logits, target_T)
    (logp_T * g_logp_T.double() + ent_T * g_ent_T.double()).sum().backward()
    return logp_T, ent_T, hidden.grad, weight.grad, logits.grad


def _close(actual, expected, **tol):
    torch.testing.assert_close(actual.double(), expected.double(), **(tol or FP32_TOL))


@pytest.mark.parametrize("chunk_tokens", [1, 5, 16, 37, 4096])
def test_vocab_parallel_matches_naive(chunk_tokens):
    hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T = _make_inputs()
    ref_logp, ref_ent, _, _, ref_grad_logits = _naive_head(hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T)
    logits_TV = (hidden_TH @ weight_VH.t()).requires_grad_()
    logp_T, ent_T = vocab_parallel_logprobs(
        logits_TV, target_T, true_vocab_size=TRUE_VOCAB, chunk_tokens=chunk_tokens
    )
    assert logp_T.dtype == ent_T.dtype == torch.float32
    (logp_T * g_logp_T + ent_T * g_ent_T).sum().backward()
    _close(logp_T, ref_logp)
    _close(ent_T, ref_ent)
    _close(logits_TV.grad, ref_grad_logits)
    assert torch.all(logits_TV.grad[:, TRUE_VOCAB:] == 0)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 16, 37, 4096])
def test_fused_head_matches_naive(chunk_tokens):
    hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T = _make_inputs()
    ref_logp, ref_ent, ref_gh, ref_gw, _ = _naive_head(hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T)
    hidden_TH.requires_grad_()
    weight_VH.requires_grad_()
    logp_T, ent_T = fused_head_logprobs(
        hidden_TH, weight_VH, target_T, true_vocab_size=TRUE_VOCAB, chunk_tokens=chunk_tokens
    )
    (logp_T * g_logp_T + ent_T * g_ent_T).sum().backward()
    _close(logp_T, ref_logp)
    _close(ent_T, ref_ent)
    _close(hidden_TH.grad, ref_gh)
    _close(weight_VH.grad, ref_gw)
    assert torch.all(weight_VH.grad[TRUE_VOCAB:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_tiles_per_chunk(monkeypatch, dtype):
    """fp32 tiles of two or three rows inside each matmul chunk / vocabulary block."""
    monkeypatch.setattr(logprobs, "_CPU_TILE_ELEMENTS", 100)
    hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T = _make_inputs(seed=5, dtype=dtype)
    expected = []
    for tile_elements in (100, 1 << 24):
        monkeypatch.setattr(logprobs, "_CPU_TILE_ELEMENTS", tile_elements)
        hidden, weight = hidden_TH.clone().requires_grad_(), weight_VH.clone().requires_grad_()
        logits_TV = (hidden_TH @ weight_VH.t()).requires_grad_()
        kwargs = dict(true_vocab_size=TRUE_VOCAB, chunk_tokens=11)
        fused = fused_head_logprobs(hidden, weight, target_T, **kwargs)
        plain = vocab_parallel_logprobs(logits_TV, target_T, **kwargs)
        for logp_T, ent_T in (fused, plain):
            (logp_T * g_logp_T + ent_T * g_ent_T).sum().backward()
        expected.append([*fused, *plain, hidden.grad, weight.grad, logits_TV.grad])
    small, large = expected
    tol = FP32_TOL if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)  # a bf16 rounding may flip
    for a, b in zip(small, large):
        torch.testing.assert_close(a, b, **tol)
    ref_logp, ref_ent, ref_gh, ref_gw, _ = _naive_head(hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T)
    if dtype == torch.float32:
        for a, b in zip(small[:2] + small[4:6], (ref_logp, ref_ent, ref_gh, ref_gw)):
            _close(a, b)


@pytest.mark.parametrize("fused", [False, True])
def test_one_output_used_and_without_entropy(fused):
    """Gradients are right when only logp, only entropy, or logp without entropy feeds the loss."""
    hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T = _make_inputs(seed=1)
    zeros_T = torch.zeros_like(g_logp_T)
    cases = [
        ("logp", g_logp_T, zeros_T, True),
        ("ent", zeros_T, g_ent_T, True),
        ("off", g_logp_T, zeros_T, False),
    ]
    for name, g_logp, g_ent, with_entropy in cases:
        _, _, ref_gh, _, ref_grad_logits = _naive_head(hidden_TH, weight_VH, target_T, g_logp, g_ent)
        kwargs = dict(true_vocab_size=TRUE_VOCAB, chunk_tokens=7, with_entropy=with_entropy)
        if fused:
            leaf = hidden_TH.clone().requires_grad_()  # weight frozen: only the hidden gradient
            logp_T, ent_T = fused_head_logprobs(leaf, weight_VH, target_T, **kwargs)
            ref_grad = ref_gh
        else:
            leaf = (hidden_TH @ weight_VH.t()).requires_grad_()
            logp_T, ent_T = vocab_parallel_logprobs(leaf, target_T, **kwargs)
            ref_grad = ref_grad_logits
        assert (ent_T is None) == (not with_entropy), name
        loss = (logp_T * g_logp).sum() if name != "ent" else (ent_T * g_ent).sum()
        loss.backward()
        _close(leaf.grad, ref_grad)


def test_bf16_inputs():
    """bf16 logits / hidden / weight: fp32 outputs from the same bf16 values, bf16 gradients."""
    hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T = _make_inputs(seed=2, dtype=torch.bfloat16)
    logits_TV = (hidden_TH @ weight_VH.t()).requires_grad_()
    ref_logp, ref_ent = _naive(logits_TV.detach().double(), target_T)
    logp_T, ent_T = vocab_parallel_logprobs(logits_TV, target_T, true_vocab_size=TRUE_VOCAB, chunk_tokens=8)
    (logp_T * g_logp_T + ent_T * g_ent_T).sum().backward()
    assert logp_T.dtype == torch.float32 and logits_TV.grad.dtype == torch.bfloat16
    _close(logp_T, ref_logp)  # same bf16 logits, fp32 math: fp32 accuracy
    _close(ent_T, ref_ent)
    ref_logits = logits_TV.detach().double().requires_grad_()
    ref_logp, ref_ent = _naive(ref_logits, target_T)
    (ref_logp * g_logp_T + ref_ent * g_ent_T).sum().backward()
    _close(logits_TV.grad, ref_logits.grad, rtol=1e-2, atol=1e-3)

    _, _, ref_gh, ref_gw, _ = _naive_head(hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T)
    hidden_TH.requires_grad_()
    weight_VH.requires_grad_()
    logp_T, ent_T = fused_head_logprobs(
        hidden_TH, weight_VH, target_T, true_vocab_size=TRUE_VOCAB, chunk_tokens=8
    )
    (logp_T * g_logp_T + ent_T * g_ent_T).sum().backward()
    assert hidden_TH.grad.dtype == weight_VH.grad.dtype == torch.bfloat16
    _close(logp_T, ref_logp, rtol=0, atol=0.05)  # logits rounded to bf16, as the output layer would
    _close(hidden_TH.grad, ref_gh, rtol=0.02, atol=0.02)
    _close(weight_VH.grad, ref_gw, rtol=0.02, atol=0.02)
    assert torch.all(weight_VH.grad[TRUE_VOCAB:] == 0)


def test_large_logits_are_stable():
    gen = torch.Generator().manual_seed(3)
    logits_TV = (torch.randn(9, 30, generator=gen) * 1e3).requires_grad_()
    target_T = torch.randint(0, 30, (9,), generator=gen)
    logp_T, ent_T = vocab_parallel_logprobs(logits_TV, target_T, chunk_tokens=4)
    (logp_T.sum() + ent_T.sum()).backward()
    ref_logits = logits_TV.detach().double().requires_grad_()
    ref = torch.log_softmax(ref_logits, -1)
    ref_logp, ref_ent = ref.gather(1, target_T.unsqueeze(1)).squeeze(1), -(ref.exp() * ref).sum(-1)
    (ref_logp.sum() + ref_ent.sum()).backward()
    assert torch.isfinite(logp_T).all() and torch.isfinite(logits_TV.grad).all()
    # |logits| ~ 1e3, where fp32 resolves 6e-5: lse and hence p carry that absolute error
    _close(logp_T, ref_logp, rtol=1e-6, atol=1e-3)
    _close(ent_T, ref_ent, rtol=1e-6, atol=1e-4)
    _close(logits_TV.grad, ref_logits.grad, rtol=1e-6, atol=1e-4)


def test_vocab_range_and_errors():
    assert vocab_range(256, 0, 2) == (0, 128)
    assert vocab_range(256, 1, 2) == (128, 256)
    with pytest.raises(ValueError, match="not divisible"):
        vocab_range(100, 0, 3)
    with pytest.raises(ValueError, match="tp_rank"):
        vocab_range(256, 2, 2)
    logits_TV = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="target_T"):
        vocab_parallel_logprobs(logits_TV, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        vocab_parallel_logprobs(logits_TV, torch.zeros(4))
    with pytest.raises(ValueError, match="chunk_tokens"):
        vocab_parallel_logprobs(logits_TV, torch.zeros(4, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="weight_VH"):
        fused_head_logprobs(torch.zeros(4, 3), torch.zeros(8, 2), torch.zeros(4, dtype=torch.long))


# --------------------------------------------------------------------------------------------------
# tensor parallel over real gloo ranks


def _tp_worker(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        group = dist.new_group(list(range(world_size)))
        hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T = _make_inputs(seed=4)
        ref_logp, ref_ent, ref_gh, ref_gw, ref_grad_logits = _naive_head(
            hidden_TH, weight_VH, target_T, g_logp_T, g_ent_T
        )
        start, end = vocab_range(PADDED_VOCAB, rank, world_size)
        kwargs = dict(tp_group=group, vocab_start=start, true_vocab_size=TRUE_VOCAB, chunk_tokens=6)

        logits_TV = (hidden_TH @ weight_VH[start:end].t()).requires_grad_()
        logp_T, ent_T = vocab_parallel_logprobs(logits_TV, target_T, **kwargs)
        (logp_T * g_logp_T + ent_T * g_ent_T).sum().backward()
        _close(logp_T, ref_logp)
        _close(ent_T, ref_ent)
        _close(logits_TV.grad, ref_grad_logits[:, start:end])

        hidden = hidden_TH.clone().requires_grad_()
        weight = weight_VH[start:end].clone().requires_grad_()
        logp_T, ent_T = fused_head_logprobs(hidden, weight, target_T, **kwargs)
        (logp_T * g_logp_T + ent_T * g_ent_T).sum().backward()
        _close(logp_T, ref_logp)
        _close(ent_T, ref_ent)
        _close(hidden.grad, ref_gh)  # all-reduced over the TP group: the full gradient on every rank
        _close(weight.grad, ref_gw[start:end])
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_naive(world_size):
    """TP=4 leaves the last rank with padding rows only (45 real rows of 64)."""
    mp.spawn(_tp_worker, args=(world_size, _free_port()), nprocs=world_size, join=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_naive(dtype):
    """The same comparison on a GPU, at a size where tiles and vocabulary blocks matter."""
    gen = torch.Generator().manual_seed(6)
    num_tokens, hidden_size, padded, true_vocab = 1000, 256, 50304, 50257
    hidden_TH = torch.randn(num_tokens, hidden_size, generator=gen).to("cuda", dtype)
    weight_VH = (torch.randn(padded, hidden_size, generator=gen) * 0.1).to("cuda", dtype)
    target_T = torch.randint(0, true_vocab, (num_tokens,), generator=gen).cuda()
    g_logp_T, g_ent_T = torch.randn(2, num_tokens, generator=gen).cuda()

    hidden = hidden_TH.double().requires_grad_()
    weight = weight_VH.double().requires_grad_()
    ref_TV = torch.log_softmax((hidden @ weight.t())[:, :true_vocab], dim=-1)
    ref_logp = ref_TV.gather(1, target_T.unsqueeze(1)).squeeze(1)
    ref_ent = -(ref_TV.exp() * ref_TV).sum(-1)
    (ref_logp * g_logp_T + ref_ent * g_ent_T).sum().backward()

    hidden_TH.requires_grad_()
    weight_VH.requires_grad_()
    logp_T, ent_T = fused_head_logprobs(
        hidden_TH, weight_VH, target_T, true_vocab_size=true_vocab, chunk_tokens=300
    )
    (logp_T * g_logp_T + ent_T * g_ent_T).sum().backward()
    # fp32 on GPU may use TF32 matmuls unless disabled; bf16 logits are rounded like the output layer
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.02, atol=0.05)
    _close(logp_T, ref_logp, **tol)
    _close(ent_T, ref_ent, **tol)
    _close(hidden_TH.grad, hidden.grad, **tol)
    _close(weight_VH.grad, weight.grad, **tol)
    assert torch.all(weight_VH.grad[true_vocab:] == 0)
