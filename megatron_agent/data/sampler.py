"""A resumable prompt sampler: epochs of (optionally shuffled) task indices, batch by batch.

The order of epoch e is a permutation seeded by (seed, e), so the sampler's whole state is
(epoch, position): a resumed run continues inside a partially consumed epoch with exactly the
prompts an uninterrupted run would have drawn, and a run resumed at an epoch boundary goes on
with the next epoch.
"""

from __future__ import annotations

import random


class PromptSampler:
    """Draws batches of task indices from `num_items` tasks, epoch after epoch."""

    def __init__(self, num_items: int, *, seed: int = 0, shuffle: bool = True):
        if num_items < 1:
            raise ValueError("the prompt sampler needs at least one task")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_items))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, batch_size: int) -> list[int]:
        """The next `batch_size` indices (an epoch boundary inside the batch rolls over)."""
        out: list[int] = []
        while len(out) < batch_size:
            order = self._order(self.epoch)
            take = min(batch_size - len(out), self.num_items - self.position)
            out.extend(order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        """{'epoch', 'position', 'seed', 'num_items', 'shuffle'}."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position; refuses a state taken over another dataset or seed."""
        for key in ("num_items", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this run has {getattr(self, key)!r}: "
                    "the dataset or data.seed changed since the checkpoint"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
