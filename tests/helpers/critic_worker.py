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
    destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()


def nan_step_is_skipped(critic, seqs, returns, run_dir: str) -> dict:
    """One `CriticUpdate` step whose old values hold a NaN in one sequence (on one data-parallel
    replica only): every rank must skip it, leaving every weight as it was."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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
    scheduler = OptimizerParamScheduler(
        critic.optimizer,
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
    update = CriticUpdate(critic, CriticConfig(), guard, scheduler, micro_batch_tokens=64)
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
