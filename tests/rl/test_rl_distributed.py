"""The same global batch on 1, 2 and 4 gloo ranks, several micro-batches each: same loss and grads.

Also: the guard's skip decision is taken by all ranks when only one rank holds the culprit.
"""

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_agent.rl import (
    GuardBatch,
    StepGuard,
    agg_loss,
    compute_kl_loss,
    compute_policy_loss,
    global_batch_counts,
)
from megatron_agent.rl.aggregate import AGG_MODES

NUM_ROWS, T, VOCAB, HORIZON = 8, 6, 13, 6


def _global_batch():
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, VOCAB, (NUM_ROWS, T), generator=g)
    lengths = torch.tensor([6, 3, 0, 5, 1, 6, 2, 4])
    mask = torch.arange(T)[None] < lengths[:, None]
    mask[0, 2] = False  # a masked tool token inside a response
    old = -torch.rand(NUM_ROWS, T, generator=g) * 3
    old[~mask] = float("nan")  # garbage where masked
    adv = torch.randn(NUM_ROWS, T, generator=g)
    ref = old - torch.rand(NUM_ROWS, T, generator=g)
    return ids, mask, old, adv, ref


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, VOCAB)

    def forward(self, ids_BT):
        logp_BTV = torch.log_softmax(self.out(self.emb(ids_BT)), -1)
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
        return logp_BTV.gather(-1, ids_BT[..., None])[..., 0], entropy_BT


def _loss(model, mb, mode, counts):
    ids, mask, old, adv, ref = mb
    logp, ent = model(ids)
    norm = {} if counts is None else {"num_tokens": counts.num_tokens, "num_seqs": counts.num_seqs}
    pg, _ = compute_policy_loss(logp, old + 0.1, adv, mask, loss_agg_mode=mode, horizon=HORIZON, **norm)
    kl, _ = compute_kl_loss(logp, ref, mask, estimator="k3+", loss_agg_mode=mode, horizon=HORIZON, **norm)
    return pg + 0.1 * kl - 0.01 * agg_loss(ent, mask, mode, horizon=HORIZON, **norm)


def _micro_batches(rows, num_micro):
    """Split rows into micro-batches, each trimmed to its own longest response (variable T)."""
    batch = _global_batch()
    out = []
    for chunk in torch.tensor_split(torch.tensor(rows), num_micro):
        parts = [x[chunk] for x in batch]
        width = max(int(parts[1].any(0).nonzero().max()) + 1 if parts[1].any() else 1, 1)
        out.append(tuple(x[:, :width] for x in parts))
    return out


def _worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = list(range(rank * NUM_ROWS // world, (rank + 1) * NUM_ROWS // world))
    mbs = _micro_batches(rows, 3 if world == 1 else 2)
    model = _Tiny()
    results = {}
    for mode in AGG_MODES:
        model.zero_grad()
        counts = global_batch_counts([mb[1] for mb in mbs])
        total = torch.zeros(())
        for mb in mbs:
            loss = _loss(model, mb, mode, counts)
            loss.backward()
            total += loss.detach()
        grads = [p.grad.clone() for p in model.parameters()]
        for t in [total, *grads]:
            dist.all_reduce(t)
        results[mode] = (total, grads)

    # Guard: only the last rank holds the culprit; every rank must skip, rank 0 names it.
    ids, mask, old, adv, _ = mbs[0]
    logp = torch.where(mask, old + 0.01, 0.0)
    if rank == world - 1:
        r, c = mask.nonzero()[0].tolist()
        logp[r, c] = old[r, c] - 29.99
    guard = StepGuard(out_dir / f"run{world}", console=False)
    sample_ids = [f"row{i}" for i in rows[: len(ids)]]
    guard.observe(
        GuardBatch(logprob=logp, old_logprob=old, advantages=adv, loss_mask=mask, sample_ids=sample_ids)
    )
    decision = guard.check(3)
    (out_dir / f"skip{world}_{rank}").write_text(json.dumps(decision.skip))
    if rank == 0:
        torch.save(results, out_dir / f"world{world}.pt")
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    for world in (1, 2, 4):
        mp.start_processes(
            _worker, args=(world, _free_port(), out), nprocs=world, join=True, start_method="spawn"
        )
    return out


@pytest.mark.parametrize("mode", AGG_MODES)
def test_same_loss_and_gradient_on_1_2_4_ranks(runs, mode):
    model = _Tiny()
    loss = _loss(model, _micro_batches(list(range(NUM_ROWS)), 1)[0], mode, counts=None)  # one pass, no dist
    loss.backward()
    expected = [p.grad for p in model.parameters()]
    for world in (1, 2, 4):
        total, grads = torch.load(runs / f"world{world}.pt")[mode]
        torch.testing.assert_close(total, loss.detach(), rtol=1e-6, atol=1e-7)
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
    assert any(e.abs().sum() > 0 for e in expected)


def test_all_ranks_agree_to_skip_and_rank0_names_the_remote_culprit(runs):
    for world in (1, 2, 4):
        assert all(json.loads((runs / f"skip{world}_{r}").read_text()) for r in range(world))
        report = json.loads((runs / f"run{world}" / "guard" / "step_000003.json").read_text())
        (culprit,) = report["breaching_tokens"]
        assert culprit["rank"] == world - 1 and culprit["sample_id"].startswith("row")
        assert culprit["log_ratio"] == pytest.approx(-29.99, abs=1e-4)
