"""torchrun worker for tests/models/test_fast_build.py (4 gloo ranks).

For every model folder and layout: log-probs and parameters of the fast build
(`policy_from_hf`: no random initialisation, per-rank slice reads) and of the old build
(random initialisation, then every full HF tensor assembled and split with `mapping.hf_to_full`
and `mapping.shard`). Then the errors of a checkpoint missing one tensor and of a model with a
parameter the mapping table does not cover. Rank 0 writes everything to a JSON file.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist


@torch.no_grad()
def load_the_old_way(chunks: list, arch, model_path: str) -> None:
    """The loader before the fast start: full tensors assembled, then this rank's piece copied."""
    from megatron.core import parallel_state as ps

    from megatron_agent.models.hf_config import padded_vocab_size
    from megatron_agent.weights.hf_io import HFCheckpointReader
    from megatron_agent.weights.load import chunk_param_rules
    from megatron_agent.weights.mapping import hf_to_full, shard

    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    padded = padded_vocab_size(arch.vocab_size, tp)
    with HFCheckpointReader(model_path) as reader:
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            for name, rule, layer in chunk_param_rules(chunk, arch, "local"):
                full = hf_to_full(rule, [reader.get(n) for n in rule.fill(layer)[1]], arch, padded)
                params[name].copy_(shard(rule, full, tp_rank, tp))


def gather_logprobs(lps) -> list:
    """The last stage's TP-rank-0 log-probs, on every rank."""
    from megatron.core import parallel_state as ps

    local = (
        [x.tolist() for x in lps] if lps is not None and ps.get_tensor_model_parallel_rank() == 0 else None
    )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return next(g for g in gathered if g is not None)


def error_of(fn) -> list:
    """[type name, message] of what `fn()` raised on this rank (['none', ''] if nothing)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return [type(e).__name__, str(e)]
    return ["none", ""]


def checkpoint_round_trip(model_path: str, opts, ckpt_dir: str) -> list[str]:
    """Save a fast-built model, load it into a model built without init; names of differing params."""
    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.checkpoint.model_io import load_checkpoint, save_checkpoint
    from megatron_agent.models.build import build_model_chunks

    source = policy_from_hf(model_path, opts, trainable=False)
    save_checkpoint(ckpt_dir, source.chunks, source.arch, hf_dir=model_path)
    chunks = build_model_chunks(source.arch, opts, trainable=False, initialize=False)
    load_checkpoint(ckpt_dir, chunks, source.arch)
    differ = [
        n
        for chunk_s, chunk_l in zip(source.chunks, chunks)
        for (n, a), (_, b) in zip(chunk_s.named_parameters(), chunk_l.named_parameters())
        if not torch.equal(a, b)
    ]
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, differ)
    return sorted({n for d in per_rank for n in d})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", default=["1x1", "2x2"])
    p.add_argument("--missing-tensor-model", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions, build_model_chunks
    from megatron_agent.models.hf_config import arch_from_hf_config, load_hf_config
    from megatron_agent.models.policy import MegatronModel
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel
    from megatron_agent.weights.load import load_hf_weights
    from tests.helpers.mp_logprobs_worker import sequences

    results = {"logprobs": {}, "params_differ": {}, "num_params": {}, "rng_drawn": {}}
    for model_path in args.models:
        name = os.path.basename(model_path)
        arch = arch_from_hf_config(load_hf_config(model_path))
        for layout in args.layouts:
            tp, pp = map(int, layout.split("x"))
            opts = BuildOptions(tp=tp, pp=pp)
            init_model_parallel(tp, pp)
            rng = torch.get_rng_state()
            fast = policy_from_hf(model_path, opts, trainable=False)
            # Random initialisation draws from the RNG (Megatron's TP tracker is the CPU one
            # here); a build without it leaves the state untouched.
            fast_drew = not torch.equal(rng, torch.get_rng_state())
            old_chunks = build_model_chunks(arch, opts, trainable=False)
            old_drew = not torch.equal(rng, torch.get_rng_state())
            load_the_old_way(old_chunks, arch, model_path)
            old = MegatronModel(old_chunks, arch, opts, trainable=False)
            key = f"{name}/{layout}"
            results["logprobs"][key] = {
                "fast": gather_logprobs(fast.logprobs(sequences(), max_tokens=64)),
                "old": gather_logprobs(old.logprobs(sequences(), max_tokens=64)),
            }
            differ = [
                n
                for chunk_f, chunk_o in zip(fast.chunks, old.chunks)
                for (n, a), (_, b) in zip(chunk_f.named_parameters(), chunk_o.named_parameters())
                if not torch.equal(a, b)
            ]
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, (differ, sum(1 for c in fast.chunks for _ in c.parameters())))
            results["params_differ"][key] = sorted({n for d, _ in per_rank for n in d})
            results["rng_drawn"][key] = {"fast": fast_drew, "old": old_drew}
            results["num_params"][key] = [n for _, n in per_rank]
            destroy_model_parallel()

    init_model_parallel(2, 2)
    opts = BuildOptions(tp=2, pp=2)
    results["checkpoint_params_differ"] = checkpoint_round_trip(args.models[-1], opts, args.ckpt_dir)
    missing = error_of(lambda: policy_from_hf(args.missing_tensor_model, opts, trainable=False))

    def load_with_extra_parameter():
        model_path = args.models[0]
        arch = arch_from_hf_config(load_hf_config(model_path))
        chunks = build_model_chunks(arch, opts, trainable=False, initialize=False)
        chunks[0].decoder.register_parameter("extra_scale", torch.nn.Parameter(torch.empty(3)))
        load_hf_weights(chunks, arch, model_path)

    unfilled = error_of(load_with_extra_parameter)
    destroy_model_parallel()
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, {"missing_tensor": missing, "unfilled_parameter": unfilled})
    results["errors"] = errors
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main()
