"""torchrun worker for the multi-rank model tests (run by tests/models/test_layouts.py).

For every model folder and every TP x PP layout given, builds the Megatron model, computes the
log-probs of fixed sequences and, optionally, trains a few steps of a masked NLL loss at one
layout. Rank 0 writes everything to a JSON file.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist


def sequences(seed: int = 0) -> list[list[int]]:
    """Fixed test sequences of different lengths (ids below the tiny tokenizer's size)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 330, (n,), generator=g).tolist() for n in (23, 7, 40, 2, 15)]


def parse_layout(layout: str) -> tuple[int, int, int]:
    """'2x2' -> (2, 2, 1); '1x2v2' -> (1, 2, 2) (TP x PP, optional virtual stages)."""
    tp_pp, _, vpp = layout.partition("v")
    tp, pp = map(int, tp_pp.split("x"))
    return tp, pp, int(vpp or 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2", "2x2"])
    p.add_argument("--train-layouts", nargs="*", default=[])
    p.add_argument("--train-models", nargs="*", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    results = {"logprobs": {}, "train": {}}
    seqs = sequences()
    for model_path in args.models:
        name = os.path.basename(model_path)
        for layout in args.layouts:
            tp, pp, vpp = parse_layout(layout)
            init_model_parallel(tp, pp, vpp)
            model = policy_from_hf(model_path, BuildOptions(tp=tp, pp=pp, vpp=vpp), trainable=False)
            lps = model.logprobs(seqs, max_tokens=64)
            local = (
                [x.tolist() for x in lps]
                if lps is not None and ps.get_tensor_model_parallel_rank() == 0
                else None
            )
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            results["logprobs"][f"{name}/{layout}"] = next(g for g in gathered if g is not None)
            destroy_model_parallel()
        if args.train_models is None or name in args.train_models:
            for layout in args.train_layouts:
                results["train"][f"{name}/{layout}"] = train_nll(model_path, layout, seqs)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()


def train_nll(model_path: str, layout: str, seqs: list[list[int]], steps: int = 6) -> dict:
    """Losses and grad norms of `steps` optimizer steps of a masked token-mean NLL at `layout`.

    Data-parallel replicas each take every dp-th sequence; the loss is normalised by the global
    token count, so losses and gradients must not depend on the layout.
    """
    from megatron.core import parallel_state as ps

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    tp, pp, vpp = parse_layout(layout)
    init_model_parallel(tp, pp, vpp)
    model = policy_from_hf(
        model_path, BuildOptions(tp=tp, pp=pp, vpp=vpp), trainable=True, optim=OptimConfig(lr=3e-3)
    )
    # Mask out the first half of every sequence's targets: only the rest carries loss.
    masks = [torch.tensor([float(i >= (len(s) - 1) // 2) for i in range(len(s) - 1)]) for s in seqs]
    num_tokens = float(sum(m.sum() for m in masks))
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = list(range(dp_rank, len(seqs), dp_size))

    def loss_fn(mb, logp_BT, entropy_BT):
        mask = mb.extras["mask"] * mb.valid_BT
        loss = -(torch.where(mask > 0, logp_BT, 0.0)).sum() / num_tokens
        return loss, {"nll_sum": -(logp_BT * mask).sum().detach()}

    losses, grad_norms = [], []
    for _ in range(steps):
        outputs, info = model.train_step(
            [seqs[k] for k in mine], loss_fn, extras={"mask": [masks[k] for k in mine]}, max_tokens=48
        )
        local = None
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            local = sum(float(o["nll_sum"]) for o in outputs)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        losses.append(sum(g for g in gathered if g is not None) / num_tokens)  # one entry per DP replica
        grad_norms.append(info["grad_norm"])
    destroy_model_parallel()
    return {"losses": losses, "grad_norms": grad_norms}


if __name__ == "__main__":
    main()
