"""Check a megatron-agent checkpoint against its HF model: logits and log-probs on the same tokens.

    python tools/convert/verify.py --hf PATH --ckpt CKPT
    torchrun --nproc_per_node 4 tools/convert/verify.py --hf PATH --ckpt CKPT --tp 2 --pp 2

Runs the HF model (transformers) and the Megatron model loaded from the checkpoint at --tp/--pp
on a random and a text batch (the text batch needs tokenizer files, in the checkpoint's hf/
folder or in --hf; without them it is skipped, with a note, and only random ids are compared);
prints max |logit diff|, max |log-prob diff| and argmax agreement.
When the HF weights have the checkpoint's dtype, both run in fp32 (the weights are then
identical, so any difference is a conversion error); otherwise (e.g. an fp32 model converted
to bf16) both run in the checkpoint's dtype with its looser tolerances. Exit status 1 when a
batch is above the tolerance for the compute dtype.

A quantized export (`megatron_to_hf.py --quantize`: config.json has the `quantization_config` of
`megatron_agent.quant.hf_folder`) is compared weight by weight instead, bit for bit: each linear
weight dequantized by ModelOpt must equal the checkpoint's weight fake-quantized by ModelOpt
(`quant.ops.fake_quantize`), every other tensor the checkpoint's rounded to bf16. Exit status 1
names each tensor that differs (transformers cannot run these layouts on CPU; equal weights make
the logits of any engine that dequantizes them the same).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import check_checkpoint, check_layout, quiet  # noqa: E402

from megatron_agent.errors import (  # noqa: E402
    InputError,
    check_positive,  # noqa: E402
    run_command,
)
from megatron_agent.models.hf_config import model_arch  # noqa: E402
from megatron_agent.platform.fast_exit import exit_process  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
"""Any of these in a folder means it may hold a tokenizer."""


def usable_tokenizer(folders: list[Path], vocab_size: int) -> tuple[Path | None, str]:
    """The first folder whose tokenizer encodes the sample text into ids below `vocab_size`,
    or (None, why none did)."""
    from megatron_agent.checkpoint.logit_check import SAMPLE_TEXT

    reasons = []
    for folder in folders:
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            reasons.append(f"{folder} has no tokenizer files")
            continue
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(folder))
            ids = [i for i in tok(SAMPLE_TEXT, add_special_tokens=False)["input_ids"] if i < vocab_size]
        except Exception as exc:  # noqa: BLE001 - a broken tokenizer only costs the text batch
            reasons.append(f"{folder}: the tokenizer does not load ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        if len(ids) < 2:
            reasons.append(
                f"{folder}: the tokenizer gives {len(ids)} ids below the vocabulary size {vocab_size}"
            )
            continue
        return folder, ""
    return None, "; ".join(reasons)


def quantized_format(hf: str):
    """The weight format of a quantized HF folder (None: not quantized); InputError for a
    quantization_config that megatron-agent does not write."""
    from megatron_agent.quant.hf_folder import folder_format

    try:
        return folder_format(hf)
    except ValueError as exc:
        raise InputError(f"--hf {hf}: {exc}") from None


def verify_quantized(args, meta: dict, arch, fmt, single: bool) -> int:
    """Compare the quantized folder --hf with the checkpoint weight by weight, bit for bit; 0 or 1."""
    import torch.distributed as dist

    from megatron_agent.checkpoint.model_io import load_checkpoint
    from megatron_agent.models.build import BuildOptions, build_model_chunks
    from megatron_agent.platform.parallel import destroy_model_parallel
    from megatron_agent.quant.formats import is_quantized_linear
    from megatron_agent.quant.hf_folder import compare_folder, weight_names
    from megatron_agent.weights.export import iter_hf_tensors

    if args.dtype != "auto" or args.atol_logits is not None or args.atol_logprobs is not None:
        print(
            "note: --dtype and --atol-* do not apply to a quantized folder: its weights are compared bit for bit"
        )
    opts = BuildOptions(tp=args.tp, pp=args.pp, dtype=meta["dtype"])  # the checkpoint's exact values
    chunks = build_model_chunks(arch, opts, trainable=False, initialize=False)
    load_checkpoint(args.ckpt, chunks, arch, verify=not single)
    tensors = dict(iter_hf_tensors(chunks, arch))  # this pipeline stage's tensors, TP gathered
    in_folder = weight_names(args.hf)
    if arch.tied_embeddings and "lm_head.weight" in in_folder and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # the source stored the tied copy
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (compare_folder(args.hf, tensors, complete=False), sorted(tensors)))
    problems = sorted({p for found, _ in gathered for p in found})
    compared = {n for _, names in gathered for n in names}
    problems += [f"{n}: in {args.hf} but not in the checkpoint" for n in sorted(set(in_folder) - compared)]
    if dist.get_rank() == 0:
        linear = sum(map(is_quantized_linear, compared))
        print(
            f"weights: {linear} linear ({fmt.name}, dequantized == the checkpoint's fake-quantized by ModelOpt) "
            f"and {len(compared) - linear} other (== the checkpoint's in bf16), compared bit for bit"
        )
        for p in problems:
            print(f"  differs: {p}")
        print(
            f"{'PASS' if not problems else 'FAIL'} ({fmt.name} folder against the {meta['dtype']} checkpoint's "
            f"weights; {len(problems)} tensor(s) differ; tp={args.tp} pp={args.pp})"
        )
    destroy_model_parallel()
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF model folder to compare with")
    p.add_argument("--ckpt", required=True, help="checkpoint folder")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--batch", type=int, default=2, help="rows per batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "checkpoint"],
        help="compute dtype of both models: fp32 (tests the weights, tight tolerances), the "
        "checkpoint's own dtype (looser tolerances), or auto: fp32 when the HF weights have the "
        "checkpoint's dtype (identical weights), the checkpoint's dtype otherwise",
    )
    p.add_argument("--atol-logits", type=float, default=None, help="override the dtype's logit tolerance")
    p.add_argument(
        "--atol-logprobs", type=float, default=None, help="override the dtype's log-prob tolerance"
    )
    args = p.parse_args(argv)
    quiet()
    # Every input is checked here, before torch.distributed starts (an InputError: exit status 2):
    # the flags, the HF folder, the checkpoint against its manifest (an altered file is named; under
    # torchrun each rank checks sizes here and rank 0 the sha256 while loading), that both hold
    # the same architecture, and the layout against the model and the processes.
    check_positive({"--batch": args.batch, "--seq-len": args.seq_len})
    arch = model_arch(args.hf, "--hf")
    fmt = quantized_format(args.hf)
    single = int(os.environ.get("WORLD_SIZE", "1")) == 1
    meta = check_checkpoint(args.ckpt, hashes=single)
    from megatron_agent.checkpoint.model_io import check_arch

    try:
        check_arch(meta, arch, f"--ckpt {args.ckpt}")
    except ValueError as exc:
        raise InputError(f"{exc}: give the HF model this checkpoint was converted from (--hf)") from None
    check_layout("verify.py", args.tp, args.pp, keep=True, arch=arch)
    import torch.distributed as dist

    from megatron_agent.checkpoint.layout import HF_DIR
    from megatron_agent.checkpoint.logit_check import TOLERANCES, check_against_hf, within
    from megatron_agent.checkpoint.model_io import load_checkpoint
    from megatron_agent.models.build import DTYPES, BuildOptions, build_model_chunks
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    init_model_parallel(args.tp, args.pp)
    if fmt is not None:
        return verify_quantized(args, meta, arch, fmt, single)
    compute = {"fp32": "fp32", "checkpoint": meta["dtype"]}.get(args.dtype)
    if compute is None:
        from megatron_agent.weights.hf_io import HFCheckpointReader

        with HFCheckpointReader(args.hf) as reader:
            same = reader.get("model.embed_tokens.weight").dtype == DTYPES[meta["dtype"]]
        compute = "fp32" if same else meta["dtype"]
    opts = BuildOptions(tp=args.tp, pp=args.pp, dtype=compute)
    chunks = build_model_chunks(arch, opts, trainable=False, initialize=False)  # the load fills all
    load_checkpoint(args.ckpt, chunks, arch, verify=not single)  # sha256 verified above in one process
    tol = dict(TOLERANCES[compute])
    if args.atol_logits is not None:
        tol["logits"] = args.atol_logits
    if args.atol_logprobs is not None:
        tol["logprobs"] = args.atol_logprobs
    tokenizer_dir, why_not = usable_tokenizer([Path(args.ckpt) / HF_DIR, Path(args.hf)], arch.vocab_size)
    if tokenizer_dir is None and dist.get_rank() == 0:
        print(f"note: text batch skipped, comparing on random ids only: {why_not}")
    reports = check_against_hf(
        chunks,
        args.hf,
        arch.vocab_size,
        DTYPES[compute],
        tokenizer_dir=tokenizer_dir,
        batch=args.batch,
        seq_len=args.seq_len,
    )
    ok = all(within(r, tol) for r in reports)
    if dist.get_rank() == 0:
        for r in reports:
            print(
                f"{r.name:>6}: max|logit diff| {r.max_logit_diff:.3e}  max|logprob diff| {r.max_logprob_diff:.3e}  "
                f"argmax agreement {r.argmax_agreement:.4f}  {'ok' if within(r, tol) else 'FAIL'}"
            )
        print(
            f"{'PASS' if ok else 'FAIL'} ({meta['dtype']} checkpoint computed in {compute}; tolerances: logits {tol['logits']}, "
            f"logprobs {tol['logprobs']}, argmax >= {tol['argmax']}; tp={args.tp} pp={args.pp})"
        )
    destroy_model_parallel()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_process(run_command(main, sys.argv[1:]))
