"""torchrun worker for tests/models/test_recompute.py (2 gloo ranks, TP2).

For each `model.recompute` setting: two optimizer steps of a token-mean NLL, recording losses,
gradient norms and how often core attention and the first transformer layer ran forward (a
recomputed module runs again in the backward pass). Rank 0 writes a JSON file.
"""

import argparse
import json

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel
    from tests.helpers.mp_logprobs_worker import sequences

    seqs = sequences()
    num_tokens = float(sum(len(s) - 1 for s in seqs))

    def loss_fn(mb, logp_BT, entropy_BT):
        loss = -torch.where(mb.valid_BT, logp_BT, 0.0).sum() / num_tokens
        return loss, {"nll_sum": loss.detach() * num_tokens}

    results = {}
    for recompute in ("none", "selective", "full"):
        init_model_parallel(2, 1)
        model = policy_from_hf(
            args.model, BuildOptions(tp=2, recompute=recompute), trainable=True, optim=OptimConfig(lr=1e-3)
        )
        config = model.chunks[0].config
        layer = model.chunks[0].module.decoder.layers[0]
        calls = {"core_attention": 0, "layer": 0}

        def count(key, calls=calls):
            def hook(*_):
                calls[key] += 1

            return hook

        layer.self_attention.core_attention.register_forward_hook(count("core_attention"))
        layer.register_forward_hook(count("layer"))
        losses, grad_norms = [], []
        for _ in range(2):
            outputs, info = model.train_step(seqs, loss_fn, max_tokens=64)
            losses.append(sum(float(o["nll_sum"]) for o in outputs) / num_tokens)
            grad_norms.append(info["grad_norm"])
        num_micro_batches = len(outputs)
        results[recompute] = {
            "granularity": config.recompute_granularity,
            "losses": losses,
            "grad_norms": grad_norms,
            "calls": calls,
            "forwards": 2 * num_micro_batches,
        }
        destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main()
