"""The RL training batch: trajectories as per-target tensors, advantages, and how it is split.

Alignment: a sequence of L ids (prompt + response) has L - 1 targets; target j predicts id j + 1.
Every per-target tensor here is [L - 1] per sequence: `loss_mask` (1 on engine-sampled response
ids only, the provenance contract), `rollout_logp` (the engine's log-prob there, 0 elsewhere),
`policy_version` (the weight version that sampled it, -1 elsewhere),
and later `old_logp`, `ref_logp`, `advantages`, `is_weights`. Padded [B, T] views (T = longest
target count) are made only where a batch-level computation needs them (advantages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_agent.rollout.trajectory import Trajectory, build_training_batch

PER_TARGET_KEYS = (
    "loss_mask",
    "rollout_logp",
    "policy_version",
    "old_logp",
    "ref_logp",
    "advantages",
    "is_weights",
)


@dataclass
class RLBatch:
    """One step's trajectories in the form the Megatron workers consume."""

    uids: list[str]
    """Trajectory uids (`<task uid>/<sample>`), one per sequence."""
    group_ids: list[str]
    """Task uid of each sequence (the GRPO group)."""
    sequences: list[list[int]]
    """Prompt + response ids."""
    rewards: torch.Tensor
    """Scalar reward per sequence [B] (fp32)."""
    tensors: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per-target fp32 tensors [L - 1] per sequence, by name (PER_TARGET_KEYS)."""

    def __len__(self) -> int:
        return len(self.sequences)

    def padded(self, key: str, fill: float = 0.0) -> torch.Tensor:
        """`tensors[key]` right-padded to [B, T] with `fill`."""
        rows = self.tensors[key]
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), fill, dtype=torch.float32)
        for b, row in enumerate(rows):
            out[b, : len(row)] = row
        return out

    def set_padded(self, key: str, values_BT: torch.Tensor) -> None:
        """Store a [B, T] tensor as per-sequence rows of each sequence's target count."""
        self.tensors[key] = [values_BT[b, : len(s) - 1].float().clone() for b, s in enumerate(self.sequences)]

    def __getstate__(self) -> dict:
        """What pickling sends (`ray.put` to every Megatron rank): the rows of each tensor name as
        one numpy array, not as hundreds of tensors.

        megatron-core replaces `torch.storage._load_from_bytes`, so a rank reads every pickled
        tensor through `torch.load`'s weights-only unpickler, written in Python: 53 ms for a
        quickstart batch of 64 sequences (448 rows), and 17 ms to pickle them, against 3 ms and
        1 ms as arrays, on every rank, every step. Rows that numpy cannot hold exactly (bfloat16,
        mixed dtypes) stay tensors. Values, dtypes and shapes come back exactly (`__setstate__`)."""
        state = dict(self.__dict__)
        state["rewards"] = _pack_rows([self.rewards]) or self.rewards
        state["tensors"] = {k: _pack_rows(rows) or rows for k, rows in self.tensors.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        """Undo `__getstate__`: tensors of their own again (Ray's arrays are read-only)."""
        state = dict(state)
        rewards = state["rewards"]
        state["rewards"] = _unpack_rows(rewards)[0] if isinstance(rewards, PackedRows) else rewards
        state["tensors"] = {
            k: _unpack_rows(rows) if isinstance(rows, PackedRows) else rows
            for k, rows in state["tensors"].items()
        }
        self.__dict__.update(state)

    def select(self, indices: list[int]) -> RLBatch:
        """The sub-batch of `indices` (in that order)."""
        return RLBatch(
            uids=[self.uids[i] for i in indices],
            group_ids=[self.group_ids[i] for i in indices],
            sequences=[self.sequences[i] for i in indices],
            rewards=self.rewards[indices],
            tensors={k: [v[i] for i in indices] for k, v in self.tensors.items()},
        )


@dataclass(frozen=True)
class PackedRows:
    """Rows of one dtype as one flat numpy array and their shapes (`RLBatch.__getstate__`)."""

    flat: np.ndarray
    shapes: tuple[tuple[int, ...], ...]


def _pack_rows(rows: list[torch.Tensor]) -> PackedRows | None:
    """`rows` as a `PackedRows`, or None where they cannot go exactly through numpy (no rows,
    another device, mixed dtypes, a dtype numpy lacks such as bfloat16, a row that needs grad)."""
    if not rows or not all(isinstance(r, torch.Tensor) for r in rows):
        return None
    dtype = rows[0].dtype
    if any(r.dtype != dtype or r.device.type != "cpu" or r.requires_grad for r in rows):
        return None
    try:
        flat = torch.cat([r.reshape(-1) for r in rows]).numpy()
    except TypeError:  # no numpy dtype (bfloat16, ...)
        return None
    return PackedRows(flat, tuple(tuple(r.shape) for r in rows))


def _unpack_rows(packed: PackedRows) -> list[torch.Tensor]:
    """The rows of `packed`, each a tensor with storage of its own."""
    flat = torch.from_numpy(np.array(packed.flat))  # a writable copy
    sizes = [int(np.prod(shape)) for shape in packed.shapes]
    return [part.reshape(shape).clone() for part, shape in zip(flat.split(sizes), packed.shapes)]


def batch_from_trajectories(
    trajectories: list[Trajectory],
    pad_id: int = 0,
    *,
    group_ids: list[str] | None = None,
    reward_offsets: torch.Tensor | None = None,
) -> RLBatch:
    """An `RLBatch` of `trajectories`; raises if a loss token lacks a rollout log-prob.

    `group_ids`: the group of each trajectory (default: its task uid); `reward_offsets` [B]: added
    to the rewards (e.g. the overlong penalty). Uses `build_training_batch`, which enforces the
    provenance contract (only `sampled` tokens carry loss, each with a finite engine log-prob).
    """
    tb = build_training_batch(trajectories, pad_id=pad_id)
    lengths = (tb["prompt_lengths_B"] + tb["response_lengths_B"]).tolist()
    rewards = tb["rewards_B"]
    if torch.isnan(rewards).any():
        bad = trajectories[int(torch.isnan(rewards).nonzero()[0])].uid
        raise ValueError(f"trajectory {bad} has no reward; every trajectory must be scored before training")
    batch = RLBatch(
        uids=[t.uid for t in trajectories],
        group_ids=list(group_ids) if group_ids is not None else [t.task_uid for t in trajectories],
        sequences=[t.all_ids for t in trajectories],
        rewards=rewards if reward_offsets is None else rewards + reward_offsets,
    )
    # Token t of a row is predicted by target t - 1: shift the token-aligned tensors left by one.
    batch.tensors["loss_mask"] = [tb["loss_mask_BT"][b, 1:n].clone() for b, n in enumerate(lengths)]
    batch.tensors["rollout_logp"] = [tb["rollout_logprobs_BT"][b, 1:n].clone() for b, n in enumerate(lengths)]
    versions = tb["policy_versions_BT"].float()  # exact: versions are far below 2**24
    batch.tensors["policy_version"] = [versions[b, 1:n].clone() for b, n in enumerate(lengths)]
    return batch


def outcome_token_rewards(batch: RLBatch) -> torch.Tensor:
    """[B, T] rewards: each sequence's scalar reward on its last loss-bearing target, 0 elsewhere."""
    mask_BT = batch.padded("loss_mask")
    rewards_BT = torch.zeros_like(mask_BT)
    for b in range(len(batch)):
        positions = mask_BT[b].nonzero()
        if len(positions):
            rewards_BT[b, int(positions[-1])] = batch.rewards[b]
    return rewards_BT


def overlong_penalty(
    response_lengths: list[int], max_length: int, buffer_len: int, factor: float
) -> torch.Tensor:
    """DAPO's soft overlong penalty [B]: 0 below max - buffer, then linear down to -factor at max."""
    lengths = torch.tensor(response_lengths, dtype=torch.float32)
    if buffer_len <= 0:
        return torch.zeros_like(lengths)
    start = max_length - buffer_len
    return -factor * ((lengths - start) / buffer_len).clamp(min=0.0, max=1.0)


def host_row(t: torch.Tensor):
    """A per-sequence row a Megatron rank returns to the driver: an fp32 numpy array of its own.

    Not a tensor: megatron-core replaces `torch.storage._load_from_bytes` with its own function, so
    a tensor pickled in a rank names megatron-core, and reading it would import megatron-core and
    TensorBoard into the driver (60 MB) for nothing. Arrays also travel as out-of-band buffers.
    `gather_rows` turns them back into tensors."""
    return t.detach().float().cpu().numpy().copy()


def keep_rows(captured: dict[str, list], mb, batch_indices: list[int], **rows_BT: torch.Tensor) -> None:
    """Append a micro-batch's rows to `captured` as the driver takes them back: each row's batch
    index under "indices" and, per keyword, its first L-1 values (its valid targets, `host_row`)."""
    for row, index in enumerate(batch_indices):
        n = int(mb.valid_BT[row].sum())
        captured["indices"].append(index)
        for key, values_BT in rows_BT.items():
            captured[key].append(host_row(values_BT[row, :n]))


def dp_shard(indices: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """This data-parallel rank's share of `indices`: every dp_size-th, starting at dp_rank."""
    return indices[dp_rank::dp_size]


def mini_batches(batch: RLBatch, num_mini_batches: int) -> list[list[int]]:
    """Split the sequences into `num_mini_batches` lists of whole groups (prompts), in order."""
    order: dict[str, list[int]] = {}
    for i, g in enumerate(batch.group_ids):
        order.setdefault(g, []).append(i)
    groups = list(order.values())
    if num_mini_batches > len(groups):
        raise ValueError(f"{num_mini_batches} mini-batches for {len(groups)} prompts")
    splits = torch.tensor_split(torch.arange(len(groups)), num_mini_batches)
    return [[i for g in split.tolist() for i in groups[g]] for split in splits]
