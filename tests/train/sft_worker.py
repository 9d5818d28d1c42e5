"""torchrun worker for tests/train/test_sft_step.py: a few `sft_step`s at several layouts.

For each layout (TP x PP; the rest of the world is data parallel) it builds the model from the
same HF folder, checks the first step's loss against a forward-only NLL of the whole batch, and
records every rank's metrics of `--steps` steps. Rank 0 writes them to `--out` as JSON.
"""

import argparse
import json

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--layouts", nargs="+", default=["2x1", "1x2", "1x1"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.data.sft import synthetic_calculator_demos, tokenize_rows
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel
    from megatron_agent.train.sft import dp_share, sft_step

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = synthetic_calculator_demos(6, seed=5, tool_use_rate=0.5)
    ids, masks, _ = tokenize_rows(tokenizer, rows)
    results = {}
    for layout in args.layouts:
        tp, pp = map(int, layout.split("x"))
        init_model_parallel(tp, pp, seed=1)
        model = policy_from_hf(
            args.model, BuildOptions(tp=tp, pp=pp), trainable=True, optim=OptimConfig(lr=2e-3)
        )
        # The forward-only NLL of the whole batch, before any step: what step 0 must report.
        lps = model.logprobs(ids, max_tokens=256)
        expected = None
        if lps is not None:
            nll = sum(-(lp * torch.tensor(m[1:], dtype=torch.float32)).sum() for lp, m in zip(lps, masks))
            expected = float(nll) / sum(sum(m[1:]) for m in masks)
        mine = dp_share(list(range(len(ids))), [len(s) for s in ids])
        steps = []
        for _ in range(args.steps):
            # A small micro-batch budget: several micro-batches per step on every rank.
            steps.append(
                sft_step(model, [ids[k] for k in mine], [masks[k] for k in mine], micro_batch_tokens=160)
            )
        local = {
            "steps": steps,
            "expected_first": expected,
            "rows": mine,
            "local_tokens": sum(sum(masks[k][1:]) for k in mine),
            "dp": ps.get_data_parallel_world_size(),
        }
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        results[layout] = gathered
        destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main()
