"""Per-token log-probs and entropy from the tensor-parallel output head, in fp32.

Each tensor-parallel rank holds a contiguous shard of the (padded) vocabulary. The full vocabulary is
never gathered: every rank reduces its shard to three fp32 numbers per token (log-sum-exp, entropy
and the target logit where it owns the target), and two all-reduces over `tp_group` combine them.
Work is chunked so that the fp32 working set stays small, and the autograd functions keep only their
inputs and per-token fp32 statistics for backward: probabilities are recomputed there, chunk by
chunk.

Two entry points:
- `vocab_parallel_logprobs`: from logits shards [T, V_local] that the caller already has.
- `fused_head_logprobs`: from the hidden states and the output-layer weight shard; the logits exist
  only one chunk at a time, in forward and again in backward (a recompute that trades one extra
  matmul for never holding [T, V] logits).

Vocabulary padding (rows with global index >= `true_vocab_size`, added by Megatron to make the
vocabulary divisible by 128 * TP) is excluded: padded rows never enter a log-sum-exp or an entropy
and get zero gradient. Padding is always at the end of the vocabulary, so on each rank the real
rows are a prefix of its shard.

Math, per token with logits z over the real vocabulary, lse = log sum exp z, p = exp(z - lse):
    logp = z[target] - lse,   entropy = -sum p log p,
    d logp / dz = onehot(target) - p,   d entropy / dz = -p * (log p + entropy).
Across ranks r with local lse_r and local entropy H_r (of the local softmax), lse = logsumexp_r lse_r
and entropy = sum_r exp(lse_r - lse) * (H_r + lse - lse_r): every term is non-negative, so the
combination is well conditioned.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Elements of one fp32 tile of elementwise work. On a CPU, 64 MiB: smaller tiles stay in cache and
# are a little faster on idle cores, but each op is a parallel region, and on shared (loaded)
# machines fewer, larger regions win clearly. Accelerators take bigger tiles (fewer launches).
_CPU_TILE_ELEMENTS = 1 << 24
_DEVICE_TILE_ELEMENTS = 1 << 26
_LOG2E = 1.4426950408889634


def vocab_range(padded_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Global [start, end) vocabulary rows held by `tp_rank` (Megatron's even split of the vocab)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, tp_size), got tp_rank={tp_rank}, tp_size={tp_size}")
    if padded_vocab_size % tp_size:
        raise ValueError(
            f"padded_vocab_size={padded_vocab_size} is not divisible by tp_size={tp_size}; "
            "pad the vocabulary to a multiple of 128 * tp first"
        )
    per_rank = padded_vocab_size // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def vocab_parallel_logprobs(
    logits_TV: torch.Tensor,
    target_T: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    true_vocab_size: int | None = None,
    chunk_tokens: int = 4096,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `target_T` and entropy, per token, from this rank's logits shard.

    logits_TV: [T, V_local] local vocabulary shard (any float dtype), global rows
        [vocab_start, vocab_start + V_local). target_T: [T] global ids in [0, true_vocab_size).
    tp_group: the tensor-parallel group the vocabulary is split over (None: a single rank).
    true_vocab_size: number of real vocabulary rows; rows at or above it are padding and ignored.
    chunk_tokens: at most this many tokens per fp32 chunk (two fp32 buffers of chunk * V_local;
        a chunk is further capped at 64 MiB per buffer on a CPU, 256 MiB on an accelerator).
    Targets are not range-checked (that would synchronise with the device). Returns fp32 (logp_T, entropy_T), entropy_T None unless `with_entropy`. Differentiable with
    respect to `logits_TV`; the gradient has the dtype of `logits_TV`.
    """
    if logits_TV.dim() != 2:
        raise ValueError(f"logits_TV must be [T, V_local], got shape {tuple(logits_TV.shape)}")
    num_valid = _num_valid_local(logits_TV.shape[1], vocab_start, true_vocab_size)
    _check_target(target_T, logits_TV.shape[0])
    _check_chunk(chunk_tokens)
    out = _VocabParallelLogprobs.apply(
        logits_TV, target_T, tp_group, vocab_start, num_valid, chunk_tokens, with_entropy
    )
    return (out[0], out[1]) if with_entropy else (out, None)


def fused_head_logprobs(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    target_T: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    true_vocab_size: int | None = None,
    chunk_tokens: int = 1024,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `target_T` and entropy from hidden states and the output-layer weight shard.

    Computes logits = hidden_TH @ weight_VH.T one chunk of `chunk_tokens` tokens at a time (in the
    input dtype, as the output layer would; the chunk buffer is chunk_tokens * V_local elements),
    then the statistics in fp32; [T, V] logits are never held. hidden_TH: [T, H], replicated over `tp_group`. weight_VH: [V_local, H], global rows
    [vocab_start, vocab_start + V_local). Other arguments as in `vocab_parallel_logprobs`.
    Backward recomputes the logits in vocabulary blocks of about chunk_tokens * V_local elements,
    writes each block's weight gradient once, accumulates the hidden gradient in fp32 and
    all-reduces it over `tp_group` (like Megatron's ColumnParallelLinear with a replicated input).
    Returns fp32 (logp_T, entropy_T or None); gradients have the dtype of the inputs.
    """
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"hidden_TH must be [T, H] and weight_VH [V_local, H], got {tuple(hidden_TH.shape)} "
            f"and {tuple(weight_VH.shape)}"
        )
    if hidden_TH.dtype != weight_VH.dtype:
        raise ValueError(f"hidden_TH is {hidden_TH.dtype} but weight_VH is {weight_VH.dtype}")
    num_valid = _num_valid_local(weight_VH.shape[0], vocab_start, true_vocab_size)
    _check_target(target_T, hidden_TH.shape[0])
    _check_chunk(chunk_tokens)
    out = _FusedHeadLogprobs.apply(
        hidden_TH, weight_VH, target_T, tp_group, vocab_start, num_valid, chunk_tokens, with_entropy
    )
    return (out[0], out[1]) if with_entropy else (out, None)


# --------------------------------------------------------------------------------------------------
# argument checks


def _num_valid_local(num_local: int, vocab_start: int, true_vocab_size: int | None) -> int:
    """Number of real (non-padding) rows at the start of this rank's shard."""
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    if true_vocab_size is None:
        return num_local
    if true_vocab_size < 1:
        raise ValueError(f"true_vocab_size must be >= 1, got {true_vocab_size}")
    return max(0, min(num_local, true_vocab_size - vocab_start))


def _check_target(target_T: torch.Tensor, num_tokens: int) -> None:
    if target_T.dim() != 1 or target_T.shape[0] != num_tokens:
        raise ValueError(f"target_T must be [T={num_tokens}], got shape {tuple(target_T.shape)}")
    if target_T.is_floating_point() or target_T.is_complex():
        raise ValueError(f"target_T must hold integer token ids, got {target_T.dtype}")


def _check_chunk(chunk_tokens: int) -> None:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


# --------------------------------------------------------------------------------------------------
# fp32 kernels on one tile of rows (plain torch ops, in place, no host synchronisation)


def _tile_rows(num_cols: int, device: torch.device) -> int:
    """Rows per fp32 tile of `num_cols` columns (see _CPU_TILE_ELEMENTS)."""
    budget = _CPU_TILE_ELEMENTS if device.type == "cpu" else _DEVICE_TILE_ELEMENTS
    return max(1, budget // max(1, num_cols))


def _local_stats(
    src_rV: torch.Tensor,
    work_rV: torch.Tensor,
    exp_rV: torch.Tensor,
    tidx_r: torch.Tensor,
    owned_r: torch.Tensor,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Local lse, local entropy and owned target logit (else 0) of the logits `src_rV`.

    work_rV (fp32, may be src_rV itself when that is fp32) and exp_rV are scratch.
    """
    tgt_r = torch.where(owned_r, src_rV.gather(1, tidx_r.unsqueeze(1)).squeeze(1).float(), 0.0)
    max_r1 = src_rV.amax(dim=1, keepdim=True).float()
    if work_rV.data_ptr() != src_rV.data_ptr():
        work_rV.copy_(src_rV)
    # exp2 of base-2 scaled logits: as accurate as exp to fp32 rounding, and cheaper on CPUs
    scaled_rV = work_rV.sub_(max_r1).mul_(_LOG2E)  # (z - max) * log2(e)
    torch.exp2(scaled_rV, out=exp_rV)
    sum_r = exp_rV.sum(dim=1)
    log_sum_r = sum_r.log()
    lse_r = max_r1.squeeze(1) + log_sum_r
    ent_r = None
    if with_entropy:
        # H = log s - sum_v e_v (z_v - max) / s
        ent_r = log_sum_r - torch.linalg.vecdot(exp_rV, scaled_rV) / (sum_r * _LOG2E)
    return lse_r, ent_r, tgt_r


def _grad_logits(
    src_rV: torch.Tensor,
    work_rV: torch.Tensor,
    exp_rV: torch.Tensor | None,
    dst_rV: torch.Tensor,
    lse_r: torch.Tensor,
    ent_r: torch.Tensor,
    g_logp_r: torch.Tensor | None,
    g_ent_r: torch.Tensor | None,
    tidx_r: torch.Tensor,
    owned_r: torch.Tensor,
) -> None:
    """Write d(sum g_logp * logp + g_ent * entropy) / dz into dst_rV, for logits z = src_rV.

    work_rV is fp32 scratch (may alias src_rV or dst_rV when fp32); exp_rV is scratch for p
    (needed only with g_ent_r). g_logp_r / g_ent_r None means zero upstream gradient.
    """
    if work_rV.data_ptr() != src_rV.data_ptr():
        work_rV.copy_(src_rV)
    log2p_rV = work_rV.sub_(lse_r.unsqueeze(1)).mul_(_LOG2E)
    if g_ent_r is not None:
        # -p (g_logp + g_ent (log p + H)) = p (log2 p * (-g_ent / log2 e) - (g_logp + g_ent H))
        shift_r = g_ent_r * ent_r if g_logp_r is None else g_ent_r * ent_r + g_logp_r
        p_rV = torch.exp2(log2p_rV, out=exp_rV)
        log2p_rV.mul_((g_ent_r / -_LOG2E).unsqueeze(1)).sub_(shift_r.unsqueeze(1)).mul_(p_rV)
    elif g_logp_r is not None:
        log2p_rV.exp2_().mul_(g_logp_r.neg().unsqueeze(1))
    else:
        log2p_rV.zero_()
    if g_logp_r is not None:
        rows_r = torch.arange(work_rV.shape[0], device=work_rV.device)
        work_rV.index_put_((rows_r, tidx_r), torch.where(owned_r, g_logp_r, 0.0), accumulate=True)
    if dst_rV.data_ptr() != work_rV.data_ptr():
        dst_rV.copy_(work_rV)


def _combine(
    lse_T: torch.Tensor,
    ent_T: torch.Tensor | None,
    tgt_T: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Combine per-rank statistics into global (logp_T, lse_T, entropy_T): two all-reduces."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return tgt_T - lse_T, lse_T, ent_T
    max_T = lse_T.clone()
    dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=tp_group)
    weight_T = torch.exp(lse_T - max_T)  # 0 on a rank whose shard is all padding (lse_T = -inf)
    parts = [weight_T, tgt_T]
    if ent_T is not None:
        term_T = weight_T * (ent_T + (max_T - lse_T))
        parts.append(torch.where(weight_T > 0, term_T, 0.0))
    stacked = torch.stack(parts)
    dist.all_reduce(stacked, group=tp_group)
    log_sum_T = stacked[0].log()
    lse_global_T = max_T + log_sum_T
    ent_global_T = stacked[2] / stacked[0] + log_sum_T if ent_T is not None else None
    return stacked[1] - lse_global_T, lse_global_T, ent_global_T


def _local_targets(target_T: torch.Tensor, vocab_start: int, num_valid: int):
    """Local column of each target (clamped into range) and whether this rank owns it."""
    tidx_T = target_T.long() - vocab_start
    owned_T = (tidx_T >= 0) & (tidx_T < num_valid)
    return tidx_T.clamp(0, max(num_valid - 1, 0)), owned_T


def _empty_stats(num_tokens: int, device: torch.device, with_entropy: bool):
    lse_T = torch.full((num_tokens,), float("-inf"), device=device)
    ent_T = torch.zeros(num_tokens, device=device) if with_entropy else None
    return lse_T, ent_T, torch.zeros(num_tokens, device=device)


def _fp32_buffer(num_elements: int, like: torch.Tensor) -> torch.Tensor | None:
    """fp32 working buffer, or None where `like` is already fp32 and can be worked on in place."""
    return None if like.dtype == torch.float32 else torch.empty(num_elements, device=like.device)


def _view(buf: torch.Tensor | None, rows: int, cols: int, fallback: torch.Tensor | None = None):
    return fallback if buf is None else buf[: rows * cols].view(rows, cols)


# --------------------------------------------------------------------------------------------------
# autograd functions


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, target_T, tp_group, vocab_start, num_valid, chunk_tokens, with_entropy):
        num_tokens, device = logits_TV.shape[0], logits_TV.device
        tidx_T, owned_T = _local_targets(target_T, vocab_start, num_valid)
        lse_T, ent_T, tgt_T = _empty_stats(num_tokens, device, with_entropy)
        if num_valid > 0 and num_tokens > 0:
            rows = min(chunk_tokens, num_tokens, _tile_rows(num_valid, device))
            work_buf = torch.empty(rows * num_valid, device=device)  # never overwrite the input
            exp_buf = torch.empty_like(work_buf)
            for t0 in range(0, num_tokens, rows):
                t1 = min(t0 + rows, num_tokens)
                lse, ent, tgt = _local_stats(
                    logits_TV[t0:t1, :num_valid],
                    _view(work_buf, t1 - t0, num_valid),
                    _view(exp_buf, t1 - t0, num_valid),
                    tidx_T[t0:t1],
                    owned_T[t0:t1],
                    with_entropy,
                )
                lse_T[t0:t1], tgt_T[t0:t1] = lse, tgt
                if with_entropy:
                    ent_T[t0:t1] = ent
        logp_T, lse_T, ent_T = _combine(lse_T, ent_T, tgt_T, tp_group)
        ctx.save_for_backward(logits_TV, tidx_T, owned_T, lse_T, ent_T if with_entropy else lse_T)
        ctx.num_valid, ctx.chunk_tokens = num_valid, chunk_tokens
        ctx.set_materialize_grads(False)
        return (logp_T, ent_T) if with_entropy else logp_T

    @staticmethod
    def backward(ctx, g_logp_T, g_ent_T=None):
        logits_TV, tidx_T, owned_T, lse_T, ent_T = ctx.saved_tensors
        num_tokens, num_valid, device = logits_TV.shape[0], ctx.num_valid, logits_TV.device
        g_logp_T = None if g_logp_T is None else g_logp_T.float()
        g_ent_T = None if g_ent_T is None else g_ent_T.float()
        grad_TV = torch.empty_like(logits_TV)
        grad_TV[:, num_valid:].zero_()
        if num_valid > 0 and num_tokens > 0:
            rows = min(ctx.chunk_tokens, num_tokens, _tile_rows(num_valid, device))
            work_buf = _fp32_buffer(rows * num_valid, grad_TV)  # fp32 gradients: work in place
            exp_buf = torch.empty(rows * num_valid, device=device) if g_ent_T is not None else None
            for t0 in range(0, num_tokens, rows):
                t1 = min(t0 + rows, num_tokens)
                dst_rV = grad_TV[t0:t1, :num_valid]
                _grad_logits(
                    logits_TV[t0:t1, :num_valid],
                    _view(work_buf, t1 - t0, num_valid, fallback=dst_rV),
                    _view(exp_buf, t1 - t0, num_valid),
                    dst_rV,
                    lse_T[t0:t1],
                    ent_T[t0:t1],
                    None if g_logp_T is None else g_logp_T[t0:t1],
                    None if g_ent_T is None else g_ent_T[t0:t1],
                    tidx_T[t0:t1],
                    owned_T[t0:t1],
                )
        return grad_TV, None, None, None, None, None, None


class _FusedHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden_TH, weight_VH, target_T, tp_group, vocab_start, num_valid, chunk_tokens, with_entropy
    ):
        num_tokens, device = hidden_TH.shape[0], hidden_TH.device
        tidx_T, owned_T = _local_targets(target_T, vocab_start, num_valid)
        lse_T, ent_T, tgt_T = _empty_stats(num_tokens, device, with_entropy)
        if num_valid > 0 and num_tokens > 0:
            weight_valid = weight_VH[:num_valid]
            chunk = min(chunk_tokens, num_tokens)
            logits_buf = torch.empty(chunk * num_valid, device=device, dtype=hidden_TH.dtype)
            tile = min(chunk, _tile_rows(num_valid, device))
            work_buf = _fp32_buffer(tile * num_valid, logits_buf)
            exp_buf = torch.empty(tile * num_valid, device=device)
            for c0 in range(0, num_tokens, chunk):
                c1 = min(c0 + chunk, num_tokens)
                logits_cV = _view(logits_buf, c1 - c0, num_valid)
                torch.mm(hidden_TH[c0:c1], weight_valid.t(), out=logits_cV)
                for t0 in range(c0, c1, tile):
                    t1 = min(t0 + tile, c1)
                    src_rV = logits_cV[t0 - c0 : t1 - c0]
                    lse, ent, tgt = _local_stats(
                        src_rV,
                        _view(work_buf, t1 - t0, num_valid, fallback=src_rV),
                        _view(exp_buf, t1 - t0, num_valid),
                        tidx_T[t0:t1],
                        owned_T[t0:t1],
                        with_entropy,
                    )
                    lse_T[t0:t1], tgt_T[t0:t1] = lse, tgt
                    if with_entropy:
                        ent_T[t0:t1] = ent
            del logits_buf, work_buf, exp_buf
        logp_T, lse_T, ent_T = _combine(lse_T, ent_T, tgt_T, tp_group)
        ctx.save_for_backward(hidden_TH, weight_VH, tidx_T, owned_T, lse_T, ent_T if with_entropy else lse_T)
        ctx.tp_group, ctx.num_valid, ctx.chunk_tokens = tp_group, num_valid, chunk_tokens
        ctx.set_materialize_grads(False)
        return (logp_T, ent_T) if with_entropy else logp_T

    @staticmethod
    def backward(ctx, g_logp_T, g_ent_T=None):
        hidden_TH, weight_VH, tidx_T, owned_T, lse_T, ent_T = ctx.saved_tensors
        num_tokens, num_valid, device = hidden_TH.shape[0], ctx.num_valid, hidden_TH.device
        g_logp_T = None if g_logp_T is None else g_logp_T.float()
        g_ent_T = None if g_ent_T is None else g_ent_T.float()
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_weight_VH = torch.empty_like(weight_VH) if need_weight else None
        if need_weight:
            grad_weight_VH[num_valid:].zero_()
        grad_hidden_TH = torch.zeros(hidden_TH.shape, device=device) if need_hidden else None  # fp32
        if num_valid > 0 and num_tokens > 0:
            low_precision = hidden_TH.dtype != torch.float32
            # Vocabulary blocks over all tokens: each block's weight gradient is one matmul that
            # reduces over every token, written once, never accumulated in low precision.
            block = max(1, min(num_valid, ctx.chunk_tokens * num_valid // num_tokens))
            logits_buf = torch.empty(num_tokens * block, device=device, dtype=hidden_TH.dtype)
            tile = min(num_tokens, _tile_rows(block, device))
            work_buf = _fp32_buffer(tile * block, logits_buf)
            exp_buf = torch.empty(tile * block, device=device) if g_ent_T is not None else None
            for v0 in range(0, num_valid, block):
                v1 = min(v0 + block, num_valid)
                weight_bH = weight_VH[v0:v1]
                logits_Tb = _view(logits_buf, num_tokens, v1 - v0)
                torch.mm(hidden_TH, weight_bH.t(), out=logits_Tb)
                in_block_T = owned_T & (tidx_T >= v0) & (tidx_T < v1)
                bidx_T = (tidx_T - v0).clamp(0, v1 - v0 - 1)
                for t0 in range(0, num_tokens, tile):
                    t1 = min(t0 + tile, num_tokens)
                    tile_rb = logits_Tb[t0:t1]  # logits in, gradient out (in place)
                    _grad_logits(
                        tile_rb,
                        _view(work_buf, t1 - t0, v1 - v0, fallback=tile_rb),
                        _view(exp_buf, t1 - t0, v1 - v0),
                        tile_rb,
                        lse_T[t0:t1],
                        ent_T[t0:t1],
                        None if g_logp_T is None else g_logp_T[t0:t1],
                        None if g_ent_T is None else g_ent_T[t0:t1],
                        bidx_T[t0:t1],
                        in_block_T[t0:t1],
                    )
                if need_weight:
                    torch.mm(logits_Tb.t(), hidden_TH, out=grad_weight_VH[v0:v1])
                if need_hidden and low_precision:
                    grad_hidden_TH.add_(torch.mm(logits_Tb, weight_bH))
                elif need_hidden:
                    grad_hidden_TH.addmm_(logits_Tb, weight_bH)
            del logits_buf, work_buf, exp_buf
        if need_hidden and ctx.tp_group is not None and dist.get_world_size(ctx.tp_group) > 1:
            dist.all_reduce(grad_hidden_TH, group=ctx.tp_group)
        if need_hidden:
            grad_hidden_TH = grad_hidden_TH.to(hidden_TH.dtype)
        return grad_hidden_TH, grad_weight_VH, None, None, None, None, None, None
