"""One process of the GPU numerics tests (tests/gpu/test_gpu_numerics.py), on GPU or on CPU.

For each (impl, dtype) asked for: the Megatron model from an HF folder, the log-probs of fixed
sequences, and with --train-steps a few BF16 training steps (Megatron DDP with fp32 gradient
reduction, the distributed optimizer with fp32 master weights). Run it with
CUDA_VISIBLE_DEVICES="" for the CPU path. Writes a JSON file.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.mp_logprobs_worker import sequences  # noqa: E402


def train_losses(model_path: str, impl: str, steps: int) -> dict:
    """Token-mean NLL of the fixed sequences before each of `steps` BF16 optimizer steps."""
    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig

    opts = BuildOptions(dtype="bf16", transformer_impl=impl)
    optim = OptimConfig(lr=3e-3, use_distributed_optimizer=True)
    model = policy_from_hf(model_path, opts, trainable=True, optim=optim)
    seqs = sequences()
    num_targets = sum(len(s) - 1 for s in seqs)

    def loss_fn(mb, logp_BT, _entropy):
        return -torch.where(mb.valid_BT, logp_BT, torch.zeros_like(logp_BT)).sum() / num_targets, {}

    losses, grad_norms, fp32_grads = [], [], None
    for _ in range(steps):
        outputs, info = model.train_step(seqs, loss_fn, max_tokens=64)
        losses.append(sum(float(o["loss"]) for o in outputs))
        grad_norms.append(info["grad_norm"])
        if fp32_grads is None:  # Megatron's grad buffers: reduced in fp32 (grad_reduce_in_fp32)
            fp32_grads = all(b.grad_dtype == torch.float32 for c in model.chunks for b in c.buffers)
    return {"losses": losses, "grad_norms": grad_norms, "fp32_grad_buffers": fp32_grads}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--impls", nargs="+", default=["local"])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    init_model_parallel(1, 1)
    result = {"device": "cuda" if torch.cuda.is_available() else "cpu", "logprobs": {}, "train": {}}
    for impl in args.impls:
        for dtype in args.dtypes:
            opts = BuildOptions(dtype=dtype, transformer_impl=impl)
            model = policy_from_hf(args.model, opts, trainable=False)
            result["logprobs"][f"{impl}/{dtype}"] = [
                x.float().cpu().tolist() for x in model.logprobs(sequences())
            ]
            del model
        if args.train_steps:
            result["train"][impl] = train_losses(args.model, impl, args.train_steps)
    destroy_model_parallel()
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
