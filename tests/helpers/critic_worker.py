"""torchrun worker for the critic tests (tests/models/test_critic.py).

For one model folder: the critic's values of fixed sequences at every TP x PP layout given
(built from the HF checkpoint with the same head seed), and the clipped value loss of a few
optimizer steps towards fixed returns at one layout. Rank 0 writes everything to a JSON file.
"""

import argparse
import json

import torch
import torch.distributed as dist

from tests.helpers.mp_logprobs_worker import parse_layout, sequences


def returns_for(seqs: list[list[int]]) -> list[torch.Tensor]:
    """Fixed regression targets: a ramp per sequence."""
    return [torch.linspace(-1.0, 1.0, len(s) - 1) for s in seqs]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--layouts", nargs="+", required=True)
    p.add_argument("--train-layout", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_agent.build_policy import critic_from_hf
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel
    from megatron_agent.rl.value_loss import clipped_value_loss

    seqs = [s for s in sequences() if len(s) >= 2]
    results = {"values": {}, "train": {}}
    for layout in args.layouts:
        tp, pp, vpp = parse_layout(layout)
        init_model_parallel(tp, pp, vpp)
        critic = critic_from_hf(args.model, BuildOptions(tp=tp, pp=pp, vpp=vpp), seed=11)
        values = critic.values(seqs, max_tokens=64)
        local = (
            [v.tolist() for v in values]
            if values is not None and ps.get_tensor_model_parallel_rank() == 0
            else None
        )
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        results["values"][layout] = next(g for g in gathered if g is not None)
        destroy_model_parallel()

    tp, pp, vpp = parse_layout(args.train_layout)
    init_model_parallel(tp, pp, vpp)
    critic = critic_from_hf(
        args.model, BuildOptions(tp=tp, pp=pp, vpp=vpp), optim=OptimConfig(lr=3e-4), seed=11
    )
    returns = returns_for(seqs)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = list(range(dp_rank, len(seqs), dp_size))
    first = critic.values([seqs[k] for k in mine], max_tokens=64)
    old = [v.clone() for v in first] if first is not None else [torch.zeros(len(seqs[k]) - 1) for k in mine]
    num_tokens = float(sum(len(s) - 1 for s in seqs))

    def loss_fn(mb, values_BT, _):
        return clipped_value_loss(
            values_BT,
            mb.extras["old"],
            mb.extras["ret"],
            mb.valid_BT,
            cliprange_value=100.0,
            normalizer=num_tokens,
        )

    losses, grad_norms = [], []
    extras = {"old": old, "ret": [returns[k] for k in mine]}
    for _ in range(8):
        outputs, info = critic.train_step([seqs[k] for k in mine], loss_fn, extras=extras, max_tokens=64)
        local = None
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            local = sum(float(o["vf_loss_sum"]) for o in outputs)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        losses.append(sum(g for g in gathered if g is not None) / num_tokens)
        grad_norms.append(info["grad_norm"])
    results["train"] = {"losses": losses, "grad_norms": grad_norms}
    results["guard"] = nan_step_is_skipped(critic, seqs, returns, args.out + ".guard")
    results["fold"] = {
        "pass": update_step(args.model, seqs, args.out + ".pass", from_update=False),
        "update": update_step(args.model, seqs, args.out + ".update", from_update=True),
    }
    destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()


def _scheduler(optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=1e-3,
        max_lr=1e-3,
        min_lr=1e-3,
        lr_warmup_steps=0,
        lr_decay_steps=10,
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def update_step(model: str, seqs, run_dir: str, *, from_update: bool) -> dict:
    """One `CriticUpdate` step of a fresh critic (the same seed each time) on fixed token rewards,
    with tool-like masked spans inside the rows: its values either from a value pass before it
    and returns from `compute_advantages` on the whole batch (`from_update=False`, what the
    driver does), or taken from the update's own forward (`values_from_update`). Returns the
    values (all sequences, in order), the metric sums and the values after the step."""
    from megatron.core import parallel_state as ps

    from megatron_agent.build_policy import critic_from_hf
    from megatron_agent.config import AlgorithmConfig, CriticConfig
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.rl import StepGuard, compute_advantages
    from megatron_agent.train.batch import RLBatch
    from megatron_agent.train.critic_update import CriticUpdate

    critic = critic_from_hf(model, BuildOptions(tp=2, pp=1), optim=OptimConfig(lr=1e-3), seed=11)
    g = torch.Generator().manual_seed(5)
    masks, rewards = [], []
    for s in seqs:
        mask = torch.ones(len(s) - 1)
        if len(s) > 10:
            mask[3:6] = 0.0  # a tool's output between two turns
        rewards.append(torch.where(mask.bool(), 0.1 * torch.randn(len(s) - 1, generator=g), 0.0))
        masks.append(mask)
    batch = RLBatch(
        uids=[str(i) for i in range(len(seqs))],
        group_ids=[str(i) for i in range(len(seqs))],
        sequences=seqs,
        rewards=torch.zeros(len(seqs)),
        tensors={"loss_mask": masks, "token_rewards": rewards},
    )
    gamma, lam = 0.99, 0.9
    if not from_update:
        values = critic.values(seqs, max_tokens=64)  # every rank is a last stage at TP2 PP1
        batch.tensors["values"] = values
        _, returns_BT = compute_advantages(
            "gae",
            batch.padded("token_rewards"),
            batch.padded("loss_mask"),
            values_BT=batch.padded("values"),
            gamma=gamma,
            lam=lam,
        )
        batch.set_padded("returns", returns_BT)
    update = CriticUpdate(
        critic,
        CriticConfig(),
        StepGuard.from_config(AlgorithmConfig(), run_dir),
        _scheduler(critic.optimizer),
        micro_batch_tokens=64,
        values_from_update=from_update,
        gamma=gamma,
        lam=lam,
    )
    sums = update.run(batch, [list(range(len(seqs)))])
    if from_update:  # each replica's rows, gathered
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, [(i, v.tolist()) for i, v in zip(*update.captured.values())])
        by_index = dict(pair for part in parts for pair in part)
        values = [by_index[i] for i in range(len(seqs))]
    else:
        values = [v.tolist() for v in values]
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, sums if ps.get_tensor_model_parallel_rank() == 0 else None)
    after = critic.values(seqs, max_tokens=64)
    return {
        "values": values,
        "sums": [r for r in reports if r],
        "after": [v.tolist() for v in after],
    }


def nan_step_is_skipped(critic, seqs, returns, run_dir: str) -> dict:
    """One `CriticUpdate` step whose old values hold a NaN in one sequence (on one data-parallel
    replica only): every rank must skip it, leaving every weight as it was."""
    from megatron_agent.config import AlgorithmConfig, CriticConfig
    from megatron_agent.rl import StepGuard
    from megatron_agent.train.batch import RLBatch
    from megatron_agent.train.critic_update import CriticUpdate

    old = [torch.zeros(len(s) - 1) for s in seqs]
    old[1][2] = float("nan")  # sequence 1: data-parallel rank 1's share at DP=2
    batch = RLBatch(
        uids=[str(i) for i in range(len(seqs))],
        group_ids=[str(i) for i in range(len(seqs))],
        sequences=seqs,
        rewards=torch.zeros(len(seqs)),
        tensors={"loss_mask": [torch.ones(len(s) - 1) for s in seqs], "values": old, "returns": returns},
    )
    guard = StepGuard.from_config(AlgorithmConfig(), run_dir)
    update = CriticUpdate(critic, CriticConfig(), guard, _scheduler(critic.optimizer), micro_batch_tokens=64)
    before = [p.detach().clone() for c in critic.chunks for p in c.parameters()]
    sums = update.run(batch, [list(range(len(seqs)))])
    unchanged = all(
        torch.equal(a, p) for a, p in zip(before, (p for c in critic.chunks for p in c.parameters()))
    )
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, {"unchanged": unchanged, "skipped": guard.skipped_steps})
    return {"ranks": flags, "reported": sums.get("critic/guard_skipped")}


if __name__ == "__main__":
    main()
