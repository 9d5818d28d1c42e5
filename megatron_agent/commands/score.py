"""`score`: per-token log-probs of given token ids with the Megatron model.

    python -m megatron_agent score --model HF_DIR --data IN.jsonl --out OUT.jsonl \
        [--tp N] [--pp N] [--dtype fp32|bf16] [--max-tokens 4096]

More than one rank: `torchrun --nproc_per_node TP*PP*DP -m megatron_agent score ...`. Each
input line has `input_ids` (a list of ints); each output line, in the same order, has `logprobs`,
len(input_ids) - 1 floats: log p(input_ids[i+1] | input_ids[:i+1]). Every input (the flags, the
model folder, the layout, every data line, the output folder) is checked before anything starts;
a mistake is one `error:` line naming it (exit status 2).

"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from megatron_agent.errors import InputError, check_positive, check_world_size
from megatron_agent.models.hf_config import check_parallel_fit, model_arch


class ScoreInputError(InputError):
    """A line of the score input is malformed."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line of `score`."""
    p = argparse.ArgumentParser(prog="megatron_agent score", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--data", required=True, help="input jsonl with an `input_ids` list per line")
    p.add_argument("--out", required=True, help="output jsonl with a `logprobs` list per line")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="model dtype")
    p.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per micro-batch")
    p.add_argument("--batch-size", type=int, default=256, help="sequences scored per schedule run")
    return p.parse_args(argv)


def _check_world_size(tp: int, pp: int, argv: list[str]) -> None:
    """tp*pp must divide torchrun's world; the error says how to launch `score`."""
    again = ["torchrun", "--nproc_per_node", str(tp * pp), "-m", "megatron_agent", "score", *argv]
    check_world_size(f"--tp {tp} --pp {pp}", tp * pp, shlex.join(again))


def check_output(path: str | Path) -> None:
    """Raise `InputError` when --out cannot be written: a folder, or its parent folder missing."""
    out = Path(path)
    if out.is_dir():
        raise InputError(f"--out {path}: is a folder: give the path of the output jsonl file")
    if not out.parent.is_dir():
        raise InputError(f"--out {path}: the folder {out.parent} does not exist: create it first")


def read_inputs(path: str | Path, *, vocab_size: int, max_length: int) -> list[list[int]]:
    """Read and check every line; raise `ScoreInputError` naming the file and the first bad line
    (or the file, when it is missing, unreadable or holds no rows)."""
    if not Path(path).exists():
        raise ScoreInputError(f"--data {path}: no such file")
    if Path(path).is_dir():
        raise ScoreInputError(f"--data {path}: is a folder, not a jsonl file")
    sequences = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ScoreInputError(
                    f"{path} line {line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}): "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                raise ScoreInputError(f"{path} line {line_no}: empty line")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ScoreInputError(f"{path} line {line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or "input_ids" not in row:
                raise ScoreInputError(f"{path} line {line_no}: missing field 'input_ids'")
            ids = row["input_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ScoreInputError(f"{path} line {line_no}: 'input_ids' must be a list of ints")
            if not ids:
                raise ScoreInputError(f"{path} line {line_no}: 'input_ids' is empty")
            bad = [t for t in ids if t < 0 or t >= vocab_size]
            if bad:
                raise ScoreInputError(
                    f"{path} line {line_no}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
                )
            if len(ids) > max_length:
                raise ScoreInputError(
                    f"{path} line {line_no}: {len(ids)} tokens exceed the model's max_position_embeddings={max_length}"
                )
            sequences.append(ids)
    if not sequences:
        raise ScoreInputError(
            f"--data {path}: no rows (the file is empty): write one JSON line with `input_ids` per sequence"
        )
    return sequences


def main(argv: list[str]) -> int:
    """Run `score`; returns the exit status."""
    args = parse_args(argv)
    # Every input is checked here, before torch.distributed, the model or any file is touched.
    check_positive(
        {"--tp": args.tp, "--pp": args.pp, "--max-tokens": args.max_tokens, "--batch-size": args.batch_size}
    )
    arch = model_arch(args.model, "--model")
    check_parallel_fit(arch, args.tp, args.pp)
    _check_world_size(args.tp, args.pp, argv)
    sequences = read_inputs(args.data, vocab_size=arch.vocab_size, max_length=arch.max_position_embeddings)
    check_output(args.out)

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel

    init_model_parallel(args.tp, args.pp)
    model = policy_from_hf(
        args.model, BuildOptions(tp=args.tp, pp=args.pp, dtype=args.dtype), trainable=False
    )
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    writer = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
    out = open(args.out, "w") if writer else None
    try:
        for start in range(0, len(sequences), args.batch_size):
            batch = sequences[start : start + args.batch_size]
            mine = list(range(dp_rank, len(batch), dp_size))
            logprobs = _score(model, [batch[k] for k in mine], args.max_tokens)
            if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
                gathered = [list(zip(mine, logprobs))]
                if dp_size > 1:
                    gathered = [None] * dp_size
                    group = ps.get_data_parallel_group(with_context_parallel=False)
                    dist.all_gather_object(gathered, list(zip(mine, logprobs)), group=group)
                if writer:
                    by_index = dict(pair for part in gathered for pair in part)
                    for k in range(len(batch)):
                        out.write(json.dumps({"logprobs": by_index[k]}) + "\n")
    finally:
        if out:
            out.close()
    destroy_model_parallel()
    dist.barrier()
    return 0


def _score(model, sequences: list[list[int]], max_tokens: int) -> list[list[float]]:
    """Log-probs of one batch (empty lists for one-token sequences)."""
    long_enough = [k for k, s in enumerate(sequences) if len(s) >= 2]
    result: list[list[float]] = [[] for _ in sequences]
    if long_enough:
        lps = model.logprobs([sequences[k] for k in long_enough], max_tokens=max_tokens)
        if lps is not None:
            for k, lp in zip(long_enough, lps):
                result[k] = lp.tolist()
    return result
