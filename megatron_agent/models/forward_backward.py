"""Forward (and backward) over Megatron's pipeline schedule for batches of variable-length sequences.

Sequences are grouped into micro-batches under a token budget (longest first, so rows of a
micro-batch have similar lengths and little padding), right-padded to the micro-batch's longest
row. With a causal mask, right padding never influences real tokens, so no attention mask is
needed. The model's output head is replaced, through GPTModel's `output_processor` hook, by the
fused vocab-parallel log-prob/entropy computation: full-vocabulary logits are never
materialised, and padded positions are removed before the head.

Per-token tensors are aligned with targets: position i of a row predicts token i + 1, so a row of
length L has L - 1 targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_agent.models.logprobs import fused_head_logprobs


@dataclass
class MicroBatch:
    """Right-padded rows of a micro-batch and per-target tensors aligned with them."""

    input_ids_BS: torch.Tensor
    """Token ids [B, S], right-padded."""
    position_ids_BS: torch.Tensor
    """Positions [B, S] (0..len-1 per row; padding continues the count)."""
    valid_BT: torch.Tensor
    """[B, S-1] bool: True where position i < len-1 predicts a real token."""
    indices: list[int]
    """Index of each row in the caller's batch."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Caller's per-target tensors [B, S-1] (loss mask, advantages, old log-probs, ...)."""
    dummy: bool = False
    """A filler added for the interleaved schedule: its loss is zeroed and its output dropped."""

    @property
    def targets_BT(self) -> torch.Tensor:
        """The target ids [B, S-1]."""
        return self.input_ids_BS[:, 1:]


def make_micro_batches(
    sequences: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    extras: dict[str, Sequence[torch.Tensor]] | None = None,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
) -> list[MicroBatch]:
    """Group `sequences` into right-padded micro-batches of at most `max_tokens` padded tokens.

    `extras[name][k]` is a per-target tensor of length len(sequences[k]) - 1. A sequence longer
    than `max_tokens` gets a micro-batch of its own. Every sequence needs at least 2 tokens.
    """
    extras = extras or {}
    for k, seq in enumerate(sequences):
        if len(seq) < 2:
            raise ValueError(f"sequence {k} has {len(seq)} tokens; at least 2 are needed for a log-prob")
        for name, values in extras.items():
            if len(values[k]) != len(seq) - 1:
                raise ValueError(
                    f"extras[{name!r}][{k}] has {len(values[k])} entries, expected {len(seq) - 1}"
                )
    order = sorted(range(len(sequences)), key=lambda k: -len(sequences[k]))
    groups: list[list[int]] = []
    for k in order:
        if groups and (len(groups[-1]) + 1) * len(sequences[groups[-1][0]]) <= max_tokens:
            groups[-1].append(k)
        else:
            groups.append([k])
    batches = []
    for group in groups:
        seq_len = len(sequences[group[0]])
        ids = torch.full((len(group), seq_len), pad_id, dtype=torch.long)
        valid = torch.zeros((len(group), seq_len - 1), dtype=torch.bool)
        for row, k in enumerate(group):
            n = len(sequences[k])
            ids[row, :n] = torch.as_tensor(sequences[k], dtype=torch.long)
            valid[row, : n - 1] = True
        mb_extras = {}
        for name, values in extras.items():
            first = torch.as_tensor(values[group[0]])
            buf = torch.zeros((len(group), seq_len - 1), dtype=first.dtype)
            for row, k in enumerate(group):
                v = torch.as_tensor(values[k])
                buf[row, : len(v)] = v
            mb_extras[name] = buf.to(device)
        positions = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand(len(group), -1)
        batches.append(
            MicroBatch(ids.to(device), positions.contiguous().to(device), valid.to(device), group, mb_extras)
        )
    return batches


# loss_fn(micro_batch, logp_BT, entropy_BT or None) -> (loss scalar, metrics dict of tensors)
LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict]]


def _head_processor(mb: MicroBatch, *, true_vocab_size: int, with_entropy: bool, chunk_tokens: int):
    """GPTModel output_processor: per-target log-probs (and entropy) [B, S-1] from hidden states."""
    from megatron.core import parallel_state as ps

    def processor(hidden_states, output_layer, output_weight, **_):
        if getattr(output_layer, "sequence_parallel", False):
            raise NotImplementedError("sequence parallelism is not supported by the log-prob head yet")
        weight = output_weight if output_weight is not None else output_layer.weight
        hidden_BSH = hidden_states.transpose(0, 1)[:, :-1]
        hidden_NH = hidden_BSH[mb.valid_BT]
        targets_N = mb.targets_BT[mb.valid_BT]
        tp_size = ps.get_tensor_model_parallel_world_size()
        vocab_start = ps.get_tensor_model_parallel_rank() * weight.shape[0]
        logp_N, entropy_N = fused_head_logprobs(
            hidden_NH,
            weight,
            targets_N,
            tp_group=ps.get_tensor_model_parallel_group() if tp_size > 1 else None,
            vocab_start=vocab_start,
            true_vocab_size=true_vocab_size,
            chunk_tokens=chunk_tokens,
            with_entropy=with_entropy,
        )
        logp_BT = hidden_BSH.new_zeros(mb.valid_BT.shape, dtype=torch.float32).masked_scatter(
            mb.valid_BT, logp_N
        )
        entropy_BT = None
        if entropy_N is not None:
            entropy_BT = torch.zeros_like(logp_BT).masked_scatter(mb.valid_BT, entropy_N)
        return logp_BT, entropy_BT

    return processor


def _value_processor(mb: MicroBatch):
    """GPTModel output_processor of a value model: values [B, S-1] (fp32, 0 at invalid
    positions) from the value head (models/value_model.py)."""

    def processor(hidden_states, output_layer, output_weight, **_):
        values_SB, _ = output_layer(hidden_states[:-1])
        return torch.where(mb.valid_BT, values_SB.transpose(0, 1), 0.0), None

    return processor


HEADS = ("logprobs", "values")
"""What a forward pass computes: the policy's log-probs, or a value model's values."""


def forward_backward(
    chunks: list,
    micro_batches: list[MicroBatch],
    *,
    true_vocab_size: int,
    loss_fn: LossFn | None = None,
    forward_only: bool = False,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
    head: str = "logprobs",
) -> list[dict]:
    """Run the pipeline schedule over `micro_batches`.

    forward_only without `loss_fn` returns, on the last pipeline stage, one dict per micro-batch
    with `logprobs` (and `entropy`) [B, S-1] in fp32 (zeros at invalid positions), or `values`
    for `head="values"` (a value model; `loss_fn` then gets the values in place of log-probs and
    None for the entropy). With `loss_fn`,
    its metrics are returned instead, and (unless forward_only) gradients are accumulated into
    the model's grad buffers. The losses of the micro-batches are SUMMED, never divided by the
    number of micro-batches or data-parallel ranks: `loss_fn` normalises by global counts (see
    `megatron_agent.rl.aggregate`). Other pipeline stages return [].
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = chunks[0].config if hasattr(chunks[0], "config") else chunks[0].module.config
    if not config.calculate_per_token_loss:
        raise AssertionError("models must be built with calculate_per_token_loss=True (see models.build)")

    if head not in HEADS:
        raise ValueError(f"head={head!r}: choose one of {HEADS}")

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if head == "values":
            processor = _value_processor(mb)
        else:
            processor = _head_processor(
                mb, true_vocab_size=true_vocab_size, with_entropy=with_entropy, chunk_tokens=chunk_tokens
            )
        output = model(mb.input_ids_BS, mb.position_ids_BS, None, output_processor=processor)

        def loss_func(output_tensor):
            logp_BT, entropy_BT = output_tensor
            if loss_fn is None:
                result = {head: logp_BT.detach(), "dummy": mb.dummy, "micro_batch": mb}
                if entropy_BT is not None:
                    result["entropy"] = entropy_BT.detach()
                return logp_BT.sum() * 0.0, torch.tensor(1, dtype=torch.int), result
            if mb.dummy:
                return logp_BT.sum() * 0.0, torch.tensor(1, dtype=torch.int), {"dummy": True}
            loss, metrics = loss_fn(mb, logp_BT, entropy_BT)
            # The schedule divides the returned loss in place: keep our metrics separate.
            metrics = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in metrics.items()}
            metrics.setdefault("loss", loss.detach().clone())
            return loss, torch.tensor(1, dtype=torch.int), metrics

        return output, loss_func

    from megatron.core import parallel_state as ps

    if len(chunks) > 1:
        micro_batches = pad_for_interleaving(micro_batches, ps.get_pipeline_model_parallel_world_size())
    max_len = max(mb.input_ids_BS.shape[1] for mb in micro_batches)
    max_rows = max(mb.input_ids_BS.shape[0] for mb in micro_batches)
    if not config.variable_seq_lengths:  # one shape for every micro-batch (see models.build)
        micro_batches = [pad_to_shape(mb, max_rows, max_len) for mb in micro_batches]
    iterators = _iterators_per_chunk(micro_batches, len(chunks))
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=max_len,
        micro_batch_size=max_rows,
        forward_only=forward_only or loss_fn is None,
    )
    return [out for out in outputs if not out.get("dummy")]


def pad_for_interleaving(micro_batches: list[MicroBatch], pp: int) -> list[MicroBatch]:
    """Make the micro-batch count a multiple of `pp`, and at least 2 * pp, as Megatron's
    interleaved schedule needs (with exactly `pp` micro-batches its all-warm-up path deadlocks
    in the p2p exchange of a forward-backward pass, measured at PP2 x VPP2 over gloo).

    Splits the micro-batch with the most rows while one has more than one row; after that,
    appends dummy copies (zero loss, output dropped).
    """
    batches = list(micro_batches)
    while len(batches) % pp or len(batches) < 2 * pp:
        widest = max(range(len(batches)), key=lambda k: batches[k].input_ids_BS.shape[0])
        mb = batches[widest]
        rows = mb.input_ids_BS.shape[0]
        if rows > 1 and not mb.dummy:
            half = rows // 2
            batches[widest : widest + 1] = [_rows(mb, slice(0, half)), _rows(mb, slice(half, rows))]
        else:
            last = batches[-1]
            batches.append(
                MicroBatch(
                    last.input_ids_BS, last.position_ids_BS, last.valid_BT, [], last.extras, dummy=True
                )
            )
    return batches


def pad_to_shape(mb: MicroBatch, rows: int, seq_len: int) -> MicroBatch:
    """`mb` right-padded to [rows, seq_len] with rows and positions that predict nothing
    (valid False, extras 0); `indices` still names the real rows, which come first."""
    r, s = mb.input_ids_BS.shape
    if (r, s) == (rows, seq_len):
        return mb

    def pad(t, fill):
        out = torch.full((rows, t.shape[1] + seq_len - s), fill, dtype=t.dtype, device=t.device)
        out[:r, : t.shape[1]] = t
        return out

    positions = torch.arange(seq_len, device=mb.position_ids_BS.device).expand(rows, -1).contiguous()
    return MicroBatch(
        pad(mb.input_ids_BS, 0),
        positions,
        pad(mb.valid_BT, False),
        mb.indices,
        {k: pad(v, 0) for k, v in mb.extras.items()},
        dummy=mb.dummy,
    )


def _rows(mb: MicroBatch, rows: slice) -> MicroBatch:
    return MicroBatch(
        mb.input_ids_BS[rows],
        mb.position_ids_BS[rows],
        mb.valid_BT[rows],
        mb.indices[rows],
        {k: v[rows] for k, v in mb.extras.items()},
    )


def _iterators_per_chunk(micro_batches: list[MicroBatch], num_chunks: int) -> list:
    """One iterator over the same micro-batches per virtual-pipeline chunk."""
    return [iter(list(micro_batches)) for _ in range(num_chunks)]


def gather_per_sequence(outputs: list[dict], key: str, num_sequences: int) -> list[torch.Tensor]:
    """Per-sequence 1-D tensors of `key` (valid targets only) from forward-only outputs, in the caller's order."""
    result: list[torch.Tensor | None] = [None] * num_sequences
    for out in outputs:
        mb = out["micro_batch"]
        for row, k in enumerate(mb.indices):
            result[k] = out[key][row][mb.valid_BT[row]].clone()
    return result
