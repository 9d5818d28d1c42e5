"""Actor and reference models: Megatron GPT chunks with log-probs and training.

`megatron_agent.build_policy.policy_from_hf(path, opts, trainable=...)` builds this rank's chunks
for the current parallel state and loads the HF weights into a `MegatronModel`. A trainable model
(the actor) is wrapped in Megatron's DDP and gets Megatron's optimizer (`wrap_for_training`); a
frozen one (the reference) can be offloaded to the CPU between uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_agent.models.build import BuildOptions
from megatron_agent.models.forward_backward import (
    LossFn,
    forward_backward,
    gather_per_sequence,
    make_micro_batches,
)
from megatron_agent.models.hf_config import ModelArch
from megatron_agent.platform.setup import device as compute_device


@dataclass
class OptimConfig:
    """Optimizer settings passed to Megatron's optimizer."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    use_distributed_optimizer: bool = False


class MegatronModel:
    """This rank's part of a Megatron GPT model (actor, reference or critic) built from an HF
    checkpoint. `head`: 'logprobs' (a policy) or 'values' (a critic, models/value_model.py)."""

    def __init__(
        self, chunks: list, arch: ModelArch, opts: BuildOptions, *, trainable: bool, head: str = "logprobs"
    ):
        self.chunks = chunks
        self.arch = arch
        self.opts = opts
        self.trainable = trainable
        self.head = head
        self.optimizer = None
        self._offloaded = False

    def wrap_for_training(self, optim: OptimConfig) -> None:
        """Wrap the chunks in Megatron's DDP and create Megatron's optimizer (once, before training)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads as megatron_finalize
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = self.chunks[0].config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=optim.use_distributed_optimizer,
        )
        self.chunks = [
            DistributedDataParallel(
                config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
            )
            for i, chunk in enumerate(self.chunks)
        ]

        def finalize(model, num_tokens=None, *args, **kwargs):
            # Our losses are already normalised by global counts: never rescale by token counts.
            return megatron_finalize(model, None, *args, **kwargs)

        config.finalize_model_grads_func = finalize
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            clip_grad=optim.grad_clip,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=optim.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.chunks)

    @property
    def true_vocab_size(self) -> int:
        """Real vocabulary rows (Megatron's padding excluded)."""
        return self.arch.vocab_size

    def logprobs(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        max_tokens: int = 4096,
        with_entropy: bool = False,
        chunk_tokens: int = 1024,
    ) -> list[torch.Tensor] | None:
        """Per-sequence fp32 log-probs of tokens 1..L-1 given their prefixes ([L-1] each).

        Returns the list on the last pipeline stage and None elsewhere.
        """
        logp, _ = self.forward_only(
            sequences, max_tokens=max_tokens, with_entropy=with_entropy, chunk_tokens=chunk_tokens
        )
        return logp

    def values(
        self, sequences: Sequence[Sequence[int]], *, max_tokens: int = 4096
    ) -> list[torch.Tensor] | None:
        """A critic's per-sequence fp32 values of the states before tokens 1..L-1 ([L-1] each),
        on the last pipeline stage; None elsewhere."""
        values, _ = self.forward_only(sequences, max_tokens=max_tokens)
        return values

    def forward_only(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        max_tokens: int = 4096,
        with_entropy: bool = False,
        chunk_tokens: int = 1024,
    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """(log-probs, entropies or None), [L-1] fp32 each, on the last pipeline stage; (None, None)
        elsewhere. A critic gives (values, None)."""
        from megatron.core import parallel_state as ps

        self.onload()
        micro_batches = make_micro_batches(sequences, max_tokens=max_tokens, device=compute_device())
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad():
            outputs = forward_backward(
                self.chunks,
                micro_batches,
                true_vocab_size=self.true_vocab_size,
                forward_only=True,
                with_entropy=with_entropy and self.head == "logprobs",
                chunk_tokens=chunk_tokens,
                head=self.head,
            )
        if not ps.is_pipeline_last_stage():
            return None, None
        logp = gather_per_sequence(outputs, self.head, len(sequences))
        if self.head == "values":
            return logp, None
        entropy = gather_per_sequence(outputs, "entropy", len(sequences)) if with_entropy else None
        return logp, entropy

    def train_step(
        self,
        sequences: Sequence[Sequence[int]],
        loss_fn: LossFn,
        *,
        extras: dict[str, Sequence[torch.Tensor]] | None = None,
        max_tokens: int = 4096,
        with_entropy: bool = False,
        chunk_tokens: int = 1024,
        skip_step: bool = False,
    ) -> tuple[list[dict], dict]:
        """Forward/backward over all micro-batches, then one optimizer step.

        Returns (per-micro-batch metrics on the last stage, step info with `grad_norm`,
        `update_successful`). `skip_step=True` computes gradients but leaves weights and
        optimizer state untouched.
        """
        if self.optimizer is None:
            raise RuntimeError("train_step on a frozen model (built with trainable=False)")
        micro_batches = make_micro_batches(
            sequences, max_tokens=max_tokens, extras=extras, device=compute_device()
        )
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = forward_backward(
            self.chunks,
            micro_batches,
            true_vocab_size=self.true_vocab_size,
            loss_fn=loss_fn,
            with_entropy=with_entropy and self.head == "logprobs",
            chunk_tokens=chunk_tokens,
            head=self.head,
        )
        if skip_step:
            return outputs, {"grad_norm": float("nan"), "update_successful": False}
        update_successful, grad_norm, _ = self.optimizer.step()
        return outputs, {"grad_norm": float(grad_norm or 0.0), "update_successful": bool(update_successful)}

    def offload(self) -> None:
        """Move a frozen model's weights to the CPU (no-op on CPU machines)."""
        if self.trainable or not torch.cuda.is_available() or self._offloaded:
            return
        for chunk in self.chunks:
            chunk.to("cpu")
        self._offloaded = True

    def onload(self) -> None:
        """Bring an offloaded model back to the GPU."""
        if not self._offloaded:
            return
        for chunk in self.chunks:
            chunk.to(compute_device())
        self._offloaded = False
