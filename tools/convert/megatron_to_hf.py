"""Export a megatron-agent checkpoint (converted, or saved by `train` / `sft`) to an HF folder.

    python tools/convert/megatron_to_hf.py --ckpt CKPT --out PATH [--dtype auto|bf16|fp32] [--max-shard-size 5GB]
    python tools/convert/megatron_to_hf.py --ckpt RUN_DIR --out PATH   # the run's newest complete checkpoint
    python tools/convert/megatron_to_hf.py --ckpt CKPT --out PATH --critic   # a gae run's critic
    python tools/convert/megatron_to_hf.py --ckpt CKPT --out PATH --quantize nvfp4   # fp8, fp8_block128, nvfp4

CKPT is a checkpoint folder (a converted one, `sft`'s, or a training `step_N`); a run folder
(`trainer.run_dir`) or a folder of `step_N` checkpoints (`checkpoint.save_dir`) means its newest
complete checkpoint. Loads from any saved TP/PP/VPP layout, verifies the checksum manifest,
streams one layer at a time into safetensors shards (with model.safetensors.index.json when there
are several), and restores config.json, the tokenizer and the generation config of the model the
run started from. Padded vocabulary rows are dropped; tied embeddings are written as the source
had them. Optimizer and trainer state are not exported. `--critic` exports a gae run's critic
instead (`<Family>ForTokenClassification` with one label: its logits are the values).
`--quantize FORMAT` writes the quantized export instead: the actor exported as above into a
temporary folder next to PATH, then PATH in the format's layout for vLLM (the decoder's linear
weights quantized by ModelOpt from the checkpoint's values, every other tensor in bf16, one
model.safetensors; `megatron_agent.quant.hf_folder`). See docs/convert.md and docs/ppo.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import check_out, quiet, report_peak, resolve_checkpoint  # noqa: E402

from megatron_agent.errors import InputError, run_command  # noqa: E402
from megatron_agent.platform.fast_exit import exit_process  # noqa: E402
from megatron_agent.quant.formats import FORMATS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ckpt",
        required=True,
        help="checkpoint folder (model/, hf/, meta.json), or a run folder / folder of step_N checkpoints "
        "(its newest complete checkpoint)",
    )
    p.add_argument("--out", required=True, help="HF folder to create")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: the checkpoint's")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--critic", action="store_true", help="export the critic of a gae run's checkpoint")
    p.add_argument("--skip-checksums", action="store_true", help="check file sizes only, not sha256")
    p.add_argument(
        "--quantize",
        choices=sorted(FORMATS),
        default=None,
        help="write the quantized export: the decoder's linear weights in this format's layout for vLLM, "
        "the rest in bf16 (docs/convert.md, 'Quantized export')",
    )
    args = p.parse_args(argv)
    quiet()
    # Every input is checked here, before torch.distributed starts (an InputError: exit status 2):
    # the checkpoint against its manifest (an altered file is named), the output folder, the size.
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise InputError(
            "megatron_to_hf.py runs on one process (it streams): run it with python, not torchrun"
        )
    ckpt, _ = resolve_checkpoint(args.ckpt, hashes=not args.skip_checksums)
    if args.critic and not (Path(ckpt) / "critic" / "model").is_dir():
        raise InputError(
            f"--critic: {ckpt} holds no critic (critic/model): only whole-run checkpoints of a run with "
            "algorithm.adv_estimator=gae have one"
        )
    if args.quantize and args.critic:
        raise InputError("--quantize exports the actor for vLLM; a critic (--critic) is not served: drop one")
    if args.quantize and args.dtype != "auto":
        raise InputError(
            f"--dtype {args.dtype} does not apply with --quantize: the linear weights are quantized from the "
            "checkpoint's own values and every other tensor is written in bf16"
        )
    check_out(args.out, args.overwrite)
    from megatron_agent.weights.hf_write import parse_size

    try:
        shard_bytes = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise InputError(f"--max-shard-size {args.max_shard_size!r}: {exc}") from None
    if shard_bytes < 1:
        raise InputError(f"--max-shard-size {args.max_shard_size!r}: must be more than 0 bytes (e.g. 5GB)")
    if args.quantize:
        check_quantizable(ckpt, args.quantize)
    from megatron_agent.checkpoint.convert import megatron_to_hf
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel
    from megatron_agent.weights.folders import staging_dir

    start = time.perf_counter()
    init_model_parallel(1, 1)
    # The quantized export quantizes the plain export, written first into a temporary folder.
    plain = staging_dir(args.out) if args.quantize else Path(args.out)
    try:
        files = megatron_to_hf(
            ckpt,
            plain,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            verify=False,  # verified above (sizes, and sha256 unless --skip-checksums)
            critic=args.critic,
        )
        if args.quantize:
            written = quantized_export(plain, Path(args.out), args.quantize, args.overwrite)
    finally:
        if args.quantize:
            shutil.rmtree(plain, ignore_errors=True)
    what = f"{len(files)} safetensors file(s)" if not args.quantize else written
    print(f"wrote {args.out} from {ckpt}: {what} in {time.perf_counter() - start:.1f} s, {report_peak()}")
    destroy_model_parallel()
    return 0


def check_quantizable(ckpt: Path, fmt_name: str) -> None:
    """Refuse (InputError naming the tensor) a model whose linear weights vLLM cannot load in the
    layout of `fmt_name` (e.g. 128 x 128 FP8 tiles straddling k and v), before any work."""
    from megatron_agent.checkpoint.layout import HF_DIR
    from megatron_agent.models.hf_config import arch_from_hf_config, load_hf_config
    from megatron_agent.quant.formats import format_named
    from megatron_agent.quant.hf_folder import check_vllm_shapes

    try:
        check_vllm_shapes(format_named(fmt_name), arch_from_hf_config(load_hf_config(ckpt / HF_DIR)))
    except ValueError as exc:
        raise InputError(f"--quantize {fmt_name}: {exc}") from None


def quantized_export(plain: Path, out: Path, fmt_name: str, overwrite: bool) -> str:
    """Write `out`, the HF folder `plain` in the layout of format `fmt_name`; returns what was written."""
    from megatron_agent.quant.formats import format_named
    from megatron_agent.quant.hf_folder import vllm_quantization_name, write_quantized_folder

    fmt = format_named(fmt_name)
    write_quantized_folder(plain, out, fmt, overwrite=overwrite)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    plain_size = sum(f.stat().st_size for f in plain.glob("*.safetensors"))
    return (
        f"{fmt_name} layout, {size / 2**20:.2f} MiB of weights ({size / plain_size:.2f} x the "
        f"{plain_size / 2**20:.2f} MiB unquantized export; vLLM: quantization='{vllm_quantization_name(fmt)}')"
    )


if __name__ == "__main__":
    exit_process(run_command(main, sys.argv[1:]))
