"""torchrun worker for tests/train/test_pipeline_forward.py: the training forward's log-probs at
PP2 x VPP2 against the forward-only pass, over several groups of micro-batches.

Rank 0 writes, per sequence, the largest |training - forward-only| log-prob difference to `--out`.
"""

import argparse
import json

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.forward_backward import forward_backward, make_micro_batches
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import init_model_parallel

    init_model_parallel(tp=1, pp=2, vpp=2, seed=1)
    opts = BuildOptions(tp=1, pp=2, vpp=2)
    model = policy_from_hf(args.model, opts, trainable=True, optim=OptimConfig(lr=0.0))
    g = torch.Generator().manual_seed(0)
    lengths = [30, 30, 30, 30, 24, 30, 17, 30]  # one row per micro-batch: 4 groups of PP
    sequences = [torch.randint(3, 60, (n,), generator=g).tolist() for n in lengths]
    expected, _ = model.forward_only(sequences, max_tokens=30, with_entropy=False)
    seen: dict[int, torch.Tensor] = {}

    def loss_fn(mb, logp_BT, entropy_BT):
        for row, k in enumerate(mb.indices):
            seen[k] = logp_BT[row][mb.valid_BT[row]].detach().clone()
        return (logp_BT * mb.valid_BT).sum() * 1e-3, {}

    for chunk in model.chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    micro_batches = make_micro_batches(sequences, max_tokens=30)
    forward_backward(model.chunks, micro_batches, true_vocab_size=model.true_vocab_size, loss_fn=loss_fn)
    result = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        result = [float((seen[k] - expected[k]).abs().max()) for k in range(len(sequences))]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        diffs = next(r for r in gathered if r is not None)
        with open(args.out, "w") as f:
            json.dump({"num_micro_batches": len(micro_batches), "max_abs_diff": diffs}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
