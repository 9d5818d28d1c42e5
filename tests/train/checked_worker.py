"""Test-only RPCs on a Megatron rank: a subclass of the trainer's worker that tests start
through `Trainer.start(actor_cls=CheckedMegatronWorker)`; the product's worker has none."""

from __future__ import annotations

import hashlib

import torch

from megatron_agent.train.megatron_worker import MegatronWorker


def state_checksum(model) -> str:
    """sha256 over this rank's parameters and optimizer state (main params, Adam moments, steps)."""
    from megatron_agent.weights.export import unwrap

    digest = hashlib.sha256()

    def add(name: str, value) -> None:
        digest.update(name.encode())
        if torch.is_tensor(value):
            digest.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())

    for i, chunk in enumerate(model.chunks):
        for name, param in unwrap(chunk).named_parameters():
            add(f"chunk{i}.{name}", param)
    optimizers = getattr(model.optimizer, "chained_optimizers", [model.optimizer])
    for k, opt in enumerate(optimizers):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for p, param in enumerate(group["params"]):
                add(f"opt{k}.group{g}.param{p}", param)
                for key, value in sorted(inner.state.get(param, {}).items()):
                    add(f"opt{k}.group{g}.param{p}.{key}", value)
    return digest.hexdigest()


class CheckedMegatronWorker(MegatronWorker):
    """`MegatronWorker` plus `state_checksum()`, to prove that a skipped step changed nothing."""

    def state_checksum(self) -> str:
        """sha256 of this rank's actor weights and optimizer state."""
        return state_checksum(self.actor)
