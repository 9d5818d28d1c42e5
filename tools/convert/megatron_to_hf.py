"""Export a megatron-agent checkpoint (converted, or saved by `train` / `sft`) to an HF folder.

    python tools/convert/megatron_to_hf.py --ckpt CKPT --out PATH [--dtype auto|bf16|fp32] [--max-shard-size 5GB]
    python tools/convert/megatron_to_hf.py --ckpt RUN_DIR --out PATH   # the run's newest complete checkpoint

CKPT is a checkpoint folder (a converted one, `sft`'s, or a training `step_N`); a run folder
(`trainer.run_dir`) or a folder of `step_N` checkpoints (`checkpoint.save_dir`) means its newest
complete checkpoint. Loads from any saved TP/PP/VPP layout, verifies the checksum manifest,
streams one layer at a time into safetensors shards (with model.safetensors.index.json when there
are several), and restores config.json, the tokenizer and the generation config of the model the
run started from. Padded vocabulary rows are dropped; tied embeddings are written as the source
had them. Optimizer and trainer state are not exported. See docs/convert.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import quiet, report_peak, resolve_checkpoint  # noqa: E402


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
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bf16 or fp32")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--skip-checksums", action="store_true", help="check file sizes only, not sha256")
    args = p.parse_args(argv)
    quiet()
    try:
        ckpt, verified = resolve_checkpoint(args.ckpt, hashes=not args.skip_checksums)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from megatron_agent.checkpoint.convert import megatron_to_hf
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    start = time.perf_counter()
    init_model_parallel(1, 1)
    files = megatron_to_hf(
        ckpt,
        args.out,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        verify=not (args.skip_checksums or verified),  # hashed above already
    )
    print(
        f"wrote {args.out} from {ckpt}: {len(files)} safetensors file(s) in {time.perf_counter() - start:.1f} s, {report_peak()}"
    )
    destroy_model_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
