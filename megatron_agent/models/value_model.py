"""The critic: the actor's GPT model with a value head in place of its vocabulary head.

The value head is a replicated `hidden -> 1` linear layer (weight and bias) that replaces the
output layer of the last pipeline stage *inside* the GPTModel, so that everything that applies
to a weight of the model applies to it: Megatron's DDP and optimizer (with its LR schedule and
grad clipping), the guard, checkpoints. Each TP rank holds the whole head and sees the whole
hidden state (no sequence parallelism), so its gradients are equal on every TP rank without a
reduction, like a layer norm's.

The transformer is built and loaded exactly as the actor's (`build_model_chunks` with the same
architecture), never tied to the embedding: a tied model's last stage would otherwise share the
vocabulary matrix the head replaces. The head starts from a normal of std 1/sqrt(hidden + 1),
drawn from a seeded generator so that every rank draws the same head.

Values are aligned with targets like log-probs: position i of a row holds V(tokens 0..i), the
value of the state in which token i + 1 is chosen.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from megatron_agent.models.build import BuildOptions, build_model_chunks
from megatron_agent.models.hf_config import ModelArch

HEAD_PREFIX = "output_layer."
"""Parameter names of the value head (what an HF load leaves to `init_value_head`)."""


class ValueHead(torch.nn.Module):
    """hidden [S, B, H] -> values [S, B] in fp32 (replicated on every TP rank)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(1, dtype=dtype, device=device))
        for param in (self.weight, self.bias):
            # Megatron's attributes for a parameter that is the same on every TP rank.
            param.tensor_model_parallel = False
            param.sequence_parallel = False

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        """Values in fp32 (GPTModel passes `weight` and `runtime_gather_output`: unused)."""
        values = F.linear(hidden.float(), self.weight.float(), self.bias.float())[..., 0]
        return values, None


def build_value_chunks(arch: ModelArch, opts: BuildOptions, *, initialize: bool = True) -> list:
    """This pipeline rank's critic chunks: the actor's chunks (untied) with a `ValueHead` as
    the last stage's output layer (its parameters are uninitialised: `init_value_head`)."""
    chunks = build_model_chunks(
        dataclasses.replace(arch, tied_embeddings=False), opts, trainable=True, initialize=initialize
    )
    for chunk in chunks:
        if getattr(chunk, "post_process", False):
            old = chunk.output_layer
            chunk.output_layer = ValueHead(arch.hidden_size, old.weight.dtype, old.weight.device)
            del old
    return chunks


@torch.no_grad()
def init_value_head(chunks: list, arch: ModelArch, seed: int) -> None:
    """Draw the head from N(0, 1/(hidden + 1)) with a generator seeded by `seed` (the same on
    every rank, so TP replicas agree)."""
    g = torch.Generator().manual_seed(seed)
    std = 1.0 / math.sqrt(arch.hidden_size + 1)
    for chunk in chunks:
        head = value_head(chunk)
        if head is not None:
            for param in (head.weight, head.bias):
                param.copy_(torch.randn(param.shape, generator=g, dtype=torch.float32) * std)


def value_head(chunk) -> ValueHead | None:
    """The chunk's value head (through a DDP wrapper), or None off the last stage."""
    module = getattr(chunk, "module", chunk)
    head = getattr(module, "output_layer", None)
    return head if isinstance(head, ValueHead) else None
