"""Convert an HF checkpoint (Llama, Qwen2/2.5, Qwen3; safetensors) into a megatron-agent checkpoint.

    python tools/convert/hf_to_megatron.py --hf PATH --out CKPT [--dtype auto|bf16|fp32]
    torchrun --nproc_per_node 4 tools/convert/hf_to_megatron.py --hf PATH --out CKPT --tp 2 --pp 2

Streams one tensor at a time; the checkpoint (Megatron torch_dist, with the HF config, tokenizer
and generation config beside it and a checksum manifest) loads at any TP/PP/VPP. --tp/--pp/--vpp
only choose how the work is split over the torchrun processes: without torchrun the conversion
runs in one process (tp=pp=1) and says so. See docs/convert.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import check_layout, check_out, quiet, report_peak  # noqa: E402

from megatron_agent.errors import run_command  # noqa: E402
from megatron_agent.models.hf_config import model_arch  # noqa: E402
from megatron_agent.platform.fast_exit import exit_process  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="checkpoint folder to create")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: the source's")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint folder")
    args = p.parse_args(argv)
    quiet()
    # Every input is checked here, before torch.distributed starts (an InputError: exit status 2).
    arch = model_arch(args.hf, "--hf")
    check_out(args.out, args.overwrite)
    args.tp, args.pp, args.vpp = check_layout(
        "hf_to_megatron.py", args.tp, args.pp, args.vpp, keep=False, arch=arch
    )
    from megatron_agent.checkpoint.convert import hf_to_megatron
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    start = time.perf_counter()
    init_model_parallel(args.tp, args.pp, args.vpp)
    import torch.distributed as dist

    meta = hf_to_megatron(
        args.hf, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, dtype=args.dtype, overwrite=args.overwrite
    )
    if dist.get_rank() == 0:
        arch = meta["arch"]
        print(
            f"wrote {args.out}: {arch['architecture']} {arch['num_layers']} layers, {meta['dtype']}, "
            f"in {time.perf_counter() - start:.1f} s, {report_peak()}"
        )
    destroy_model_parallel()
    return 0


if __name__ == "__main__":
    exit_process(run_command(main, sys.argv[1:]))
