"""Compare a Megatron model with its HF original on the same token batches (tools/convert/verify.py).

The Megatron side runs Megatron's pipeline schedule (any TP/PP) and gathers the TP shards of the
logits on the last stage; the HF side runs transformers' forward on that rank. Reported per
batch: max |logit diff| and max |log-prob diff| over the real vocabulary (log-probs in fp32), and
the fraction of positions where both argmaxes agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# Per checkpoint dtype: max |logit diff|, max |log-prob diff|, min argmax agreement.
TOLERANCES = {
    "fp32": {"logits": 1e-3, "logprobs": 1e-3, "argmax": 0.999},
    "bf16": {"logits": 0.25, "logprobs": 0.25, "argmax": 0.95},
}

SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Which city is the capital of the country where "
    'the river flows? <tool_call>{"name": "search", "arguments": {"query": "capital"}}</tool_call> '
    "<tool_response>\nParis is the capital of France.\n</tool_response> <answer>Paris</answer> "
    "def add(a, b):\n    return a + b\nprint(add(2, 3)) What is 12 + 7? The answer is 19."
)


@dataclass
class BatchReport:
    """The comparison of one batch."""

    name: str
    max_logit_diff: float
    max_logprob_diff: float
    argmax_agreement: float


def token_batches(
    tokenizer_dir: str | Path | None, vocab_size: int, *, batch: int, seq_len: int, seed: int = 0
):
    """{'random': ids [B, S], 'text': ids [B, S]} (text from the tokenizer, repeated as needed)."""
    gen = torch.Generator().manual_seed(seed)
    batches = {"random": torch.randint(0, vocab_size, (batch, seq_len), generator=gen)}
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        ids = tok(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
        ids = [i for i in ids if i < vocab_size]
        need = batch * seq_len
        stream = (ids * (need // max(len(ids), 1) + 1))[:need]
        batches["text"] = torch.tensor(stream, dtype=torch.long).view(batch, seq_len)
    return batches


def megatron_logits(chunks: list, input_ids_BS: torch.Tensor, true_vocab_size: int) -> torch.Tensor | None:
    """fp32 logits [B, S, V] over the real vocabulary on the last pipeline stage (None elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if len(chunks) != 1:
        raise ValueError("logit comparison supports one model chunk per rank (no virtual pipeline)")
    device = next(chunks[0].parameters()).device
    ids = input_ids_BS.to(device)
    positions = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids).contiguous()
    tp_size = ps.get_tensor_model_parallel_world_size()
    collected = []

    def forward_step(data_iterator, model):
        next(data_iterator)
        output = model(ids, positions, None)

        def loss_func(logits_BSv):
            logits_BSv = logits_BSv.float().contiguous()
            if tp_size > 1:
                parts = [torch.empty_like(logits_BSv) for _ in range(tp_size)]
                dist.all_gather(parts, logits_BSv, group=ps.get_tensor_model_parallel_group())
                logits_BSv = torch.cat(parts, dim=-1)
            collected.append(logits_BSv[..., :true_vocab_size])
            return logits_BSv.sum() * 0.0, torch.tensor(1, dtype=torch.int), {}

        return output, loss_func

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=chunks[0],
            num_microbatches=1,
            seq_length=ids.shape[1],
            micro_batch_size=ids.shape[0],
            forward_only=True,
        )
    return collected[0].cpu() if ps.is_pipeline_last_stage() else None


def compare_logits(
    name: str, ours_BSV: torch.Tensor, ref_BSV: torch.Tensor, input_ids_BS: torch.Tensor
) -> BatchReport:
    """Max |logit diff|, max |log-prob diff| of the next tokens, argmax agreement."""
    ours, ref = ours_BSV.float(), ref_BSV.float()
    logp_ours = torch.log_softmax(ours[:, :-1], dim=-1).gather(-1, input_ids_BS[:, 1:, None])
    logp_ref = torch.log_softmax(ref[:, :-1], dim=-1).gather(-1, input_ids_BS[:, 1:, None])
    return BatchReport(
        name=name,
        max_logit_diff=(ours - ref).abs().max().item(),
        max_logprob_diff=(logp_ours - logp_ref).abs().max().item(),
        argmax_agreement=(ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    )


def within(report: BatchReport, tol: dict) -> bool:
    """Whether a batch report is within the tolerances."""
    return (
        report.max_logit_diff <= tol["logits"]
        and report.max_logprob_diff <= tol["logprobs"]
        and report.argmax_agreement >= tol["argmax"]
    )


def check_against_hf(
    chunks: list,
    hf_dir: str | Path,
    true_vocab_size: int,
    dtype: torch.dtype,
    *,
    tokenizer_dir: str | Path | None,
    batch: int = 2,
    seq_len: int = 64,
) -> list[BatchReport]:
    """Collective: compare the Megatron chunks with the HF model on random and text batches.

    The reports are computed on the last pipeline stage and broadcast to every rank.
    """
    from megatron.core import parallel_state as ps

    batches = token_batches(tokenizer_dir, true_vocab_size, batch=batch, seq_len=seq_len)
    ours = {name: megatron_logits(chunks, ids, true_vocab_size) for name, ids in batches.items()}
    reports = None
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype)
        model.eval()
        reports = []
        with torch.no_grad():
            for name, ids in batches.items():
                ref = model(input_ids=ids).logits[..., :true_vocab_size]
                reports.append(compare_logits(name, ours[name], ref, ids))
    box = [reports]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=_last_stage_tp0_rank())
    return box[0]


def _last_stage_tp0_rank() -> int:
    """Global rank of the first TP rank of the last pipeline stage in data-parallel replica 0."""
    from megatron.core import parallel_state as ps

    candidate = torch.tensor(
        [
            dist.get_rank()
            if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            else 1 << 30
        ]
    )
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN)
    return int(candidate.item())
