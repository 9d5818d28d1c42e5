"""The trainer's own log-probs of given token ids, from a training checkpoint (one process, or
tp*pp gloo ranks under torchrun): the Megatron model built at --tp/--pp, loaded with the
checkpoint loader the trainer uses, scored with `MegatronModel.logprobs` (the scoring path of
`python -m megatron_agent score`).

    torchrun --nproc_per_node 2 tests/convert/export_score.py CKPT IN.json OUT.json --tp 2

IN.json: a list of token-id lists; OUT.json (written by one rank): the list of log-prob lists.
"""

from __future__ import annotations

import argparse
import json
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("inputs")
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    args = p.parse_args()
    from megatron.core import parallel_state as ps

    from megatron_agent.checkpoint.layout import HF_DIR
    from megatron_agent.checkpoint.model_io import load_checkpoint
    from megatron_agent.models.build import BuildOptions, build_model_chunks
    from megatron_agent.models.hf_config import arch_from_hf_config, load_hf_config
    from megatron_agent.models.policy import MegatronModel
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    init_model_parallel(args.tp, args.pp)
    arch = arch_from_hf_config(load_hf_config(f"{args.ckpt}/{HF_DIR}"))
    opts = BuildOptions(tp=args.tp, pp=args.pp, dtype="fp32")
    chunks = build_model_chunks(arch, opts, trainable=False, initialize=False)
    load_checkpoint(args.ckpt, chunks, arch)
    model = MegatronModel(chunks, arch, opts, trainable=False)
    sequences = json.load(open(args.inputs))
    logprobs = model.logprobs(sequences)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        with open(args.out, "w") as f:
            json.dump([lp.tolist() for lp in logprobs], f)
    destroy_model_parallel()


if __name__ == "__main__":
    main()
