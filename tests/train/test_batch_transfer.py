"""The RL batch as the Megatron ranks receive it: pickled with numpy arrays, back exactly.

The trainer hands every rank its batch through Ray (`ray.put`), which pickles it with protocol 5
and out-of-band buffers; the ranks read those buffers read-only. Here the same pickling runs in
one process, with the buffers made read-only as Ray's are.
"""

from __future__ import annotations

import pickle
import sys

import pytest
import torch

from megatron_agent.train.batch import PER_TARGET_KEYS, RLBatch


def _batch(num_sequences: int = 12) -> RLBatch:
    g = torch.Generator().manual_seed(0)
    sequences = [list(range(int(torch.randint(3, 40, (1,), generator=g)))) for _ in range(num_sequences)]
    tensors = {k: [torch.randn(len(s) - 1, generator=g) for s in sequences] for k in PER_TARGET_KEYS}
    tensors["loss_mask"] = [torch.rand(len(s) - 1, generator=g) > 0.5 for s in sequences]  # bool rows
    tensors["token_ids"] = [torch.tensor(s[1:], dtype=torch.long) for s in sequences]  # int64 rows
    tensors["matrix"] = [torch.randn(2, 3, generator=g) for _ in sequences]  # rows of any shape
    return RLBatch(
        uids=[f"t{i}/0" for i in range(num_sequences)],
        group_ids=[f"t{i // 4}" for i in range(num_sequences)],
        sequences=sequences,
        rewards=torch.randn(num_sequences, generator=g),
        tensors=tensors,
    )


def _ray_pickle(obj):
    """What Ray does to `obj` on `ray.put`: protocol 5, its buffers out of band."""
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return data, buffers


def _ray_unpickle(data, buffers):
    """What a Ray worker reads: the buffers as read-only memory."""
    return pickle.loads(data, buffers=[memoryview(bytes(b.raw())) for b in buffers])


def _as_ray_sends(obj):
    return _ray_unpickle(*_ray_pickle(obj))


def _assert_same(a: RLBatch, b: RLBatch) -> None:
    assert (a.uids, a.group_ids, a.sequences) == (b.uids, b.group_ids, b.sequences)
    assert a.rewards.dtype == b.rewards.dtype and torch.equal(a.rewards, b.rewards)
    assert sorted(a.tensors) == sorted(b.tensors)
    for key in a.tensors:
        assert len(a.tensors[key]) == len(b.tensors[key]), key
        for x, y in zip(a.tensors[key], b.tensors[key]):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), key


def test_the_batch_comes_back_bit_for_bit_with_rows_of_their_own():
    batch = _batch()
    got = _as_ray_sends(batch)
    _assert_same(batch, got)
    rows = got.tensors["advantages"]
    pointers = {r.untyped_storage().data_ptr() for r in rows}
    assert len(pointers) == len(rows), "rows share a storage"
    before = rows[1].clone()
    rows[0].add_(1.0)  # writable, and no other row moves with it
    assert torch.equal(rows[1], before)
    got.rewards.mul_(2.0)
    assert torch.equal(got.rewards, batch.rewards * 2.0)


def test_no_tensor_storage_is_unpickled(monkeypatch):
    # megatron-core replaces this function with one that reads through torch.load's weights-only
    # unpickler, slowly: a batch sent as arrays never calls it.
    def refuse(_data):
        raise AssertionError("a tensor storage was unpickled")

    batch = _batch()
    sent, rows_sent = _ray_pickle(batch), _ray_pickle(batch.tensors["advantages"])
    # Unpickling finds the loader by the name pickling recorded: torch's, or megatron-core's own
    # once megatron-core was imported in this process (by an earlier test).
    loader = torch.storage._load_from_bytes
    monkeypatch.setattr(torch.storage, "_load_from_bytes", refuse)
    monkeypatch.setattr(sys.modules[loader.__module__], loader.__qualname__, refuse)
    _assert_same(batch, _ray_unpickle(*sent))
    with pytest.raises(AssertionError, match="storage was unpickled"):
        _ray_unpickle(*rows_sent)  # the rows as tensors would call it


def test_rows_numpy_cannot_hold_travel_as_tensors():
    batch = _batch(4)
    batch.tensors["bf16"] = [torch.randn(5).bfloat16() for _ in range(4)]
    batch.tensors["mixed"] = [
        torch.zeros(2),
        torch.zeros(2, dtype=torch.float64),
        torch.ones(3),
        torch.ones(1),
    ]
    batch.tensors["empty"] = []
    got = _as_ray_sends(batch)
    _assert_same(batch, got)
    assert got.tensors["bf16"][0].dtype == torch.bfloat16
    assert got.tensors["mixed"][1].dtype == torch.float64


def test_a_selected_sub_batch_travels_too():
    batch = _batch()
    sub = batch.select([5, 0, 3])
    _assert_same(sub, _as_ray_sends(sub))
