"""Save and load the model weights of a checkpoint: Megatron dist_checkpointing (torch_dist).

`save_checkpoint` writes this job's model chunks with Megatron's own sharded state dict, so the
checkpoint loads at any TP/PP/VPP: Megatron reshards on load, and the vocabulary tensors are
marked shape-flexible by Megatron, so a padded size that differs between layouts (vocabulary
padded to a multiple of 128 x TP) loads too: real rows are read, padded rows start at zero.
Writing is atomic (staging folder, then rename), with the HF side files, `meta.json` and a
checksum manifest (see `layout`). `load_checkpoint` verifies the manifest first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_agent.checkpoint.layout import (
    HF_DIR,
    MODEL_DIR,
    copy_hf_side_files,
    read_meta,
    write_meta,
)
from megatron_agent.checkpoint.manifest import verify_manifest, write_manifest
from megatron_agent.models.build import DTYPES
from megatron_agent.models.hf_config import ModelArch
from megatron_agent.weights.export import unwrap
from megatron_agent.weights.folders import publish, staging_dir
from megatron_agent.weights.hf_io import HFCheckpointReader

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def on_rank0(fn: Callable[[], object]) -> object:
    """Run `fn` on rank 0 only; its result (or its error, re-raised everywhere) reaches every rank."""
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[1] = e
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return box[0]


def model_sharded_state_dict(chunks: list) -> dict:
    """Megatron's sharded state dict of this rank's chunks ({'chunk{i}': ...})."""
    return {f"chunk{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def arch_to_meta(arch: ModelArch) -> dict:
    """The architecture as JSON-able fields."""
    return dataclasses.asdict(arch)


def check_arch(meta: dict, arch: ModelArch, where: str) -> None:
    """Raise ValueError naming the fields where a checkpoint's architecture differs from `arch`."""
    saved = meta.get("arch", {})
    expected = arch_to_meta(arch)
    diff = [
        f"{k}: checkpoint {saved.get(k)!r} vs model {v!r}" for k, v in expected.items() if saved.get(k) != v
    ]
    if diff:
        raise ValueError(f"{where} holds a different architecture: " + "; ".join(diff))


def source_stores_tied_lm_head(hf_dir: str | Path, arch: ModelArch) -> bool:
    """Whether a tied HF checkpoint also stores `lm_head.weight` (the export then writes it too)."""
    if not arch.tied_embeddings:
        return False
    with HFCheckpointReader(hf_dir) as reader:
        return "lm_head.weight" in reader.names()


def begin_save(final: str | Path, subdirs: list[str], *, overwrite: bool = False) -> Path:
    """Collective: rank 0 picks and creates a staging folder with `subdirs`; every rank gets its path.

    Fails before anything is written when `final` exists and `overwrite` is False.
    """

    def make():
        if Path(final).exists() and not overwrite:
            raise FileExistsError(f"{final} exists; remove it or pass overwrite=True (--overwrite)")
        staging = staging_dir(final)
        for sub in subdirs:
            (staging / sub).mkdir(parents=True)
        return str(staging)

    return Path(on_rank0(make))


@contextlib.contextmanager
def discard_on_error(staging: Path):
    """Remove this rank's view of a staging folder when writing into it fails (rank 0 deletes)."""
    try:
        yield
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def finish_save(
    staging: Path,
    final: str | Path,
    *,
    hf_dir: str | Path,
    meta: dict,
    overwrite: bool,
    known_digests: dict[str, str] | None = None,
) -> None:
    """Collective: rank 0 adds HF side files, meta.json and the manifest, then renames into place.

    `known_digests`: this rank's files already hashed and synced (relative to `staging`); the
    ranks' dictionaries are gathered so that rank 0 reads only the files nobody hashed.
    """
    known = dict(known_digests or {})
    if dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, known)
        for part in gathered:
            known.update(part)

    def finish():
        copy_hf_side_files(hf_dir, staging / HF_DIR)
        write_meta(staging, meta)
        write_manifest(staging, known=known)
        publish(staging, final, overwrite=overwrite)

    on_rank0(finish)


def keep_write_results_in_process() -> None:
    """Make Megatron's checkpoint writer pass its results through an in-process queue.

    Megatron's torch_dist writer collects the results of its writer threads in a global queue
    that it creates, on first use, as a `multiprocessing.Manager().Queue()`: a spawned server
    process (about 370 MB resident: it imports what the rank's main module imports) that lives
    as long as the rank, for a queue that a synchronous save only uses inside this process (the
    threads put, this process gets). Our saves are synchronous, so a `queue.Queue` serves; an
    already created queue, or a Megatron without this global, is left as it is."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(
    ckpt_dir: str | Path,
    chunks: list,
    arch: ModelArch,
    *,
    hf_dir: str | Path,
    overwrite: bool = False,
    extra_meta: dict | None = None,
    extra_writers: dict[str, Callable[[Path], None]] | None = None,
) -> Path:
    """Collective: write this job's model chunks to `ckpt_dir` atomically; returns the path.

    `hf_dir` is the HF folder the model came from (its config, tokenizer and generation config
    are stored in `<ckpt>/hf`). `extra_writers[name](folder)` runs on every rank to add a
    sub-folder (trainer state such as the optimizer), before the manifest is written;
    `extra_meta` is merged into meta.json.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    extra_writers = extra_writers or {}
    keep_write_results_in_process()
    staging = begin_save(ckpt_dir, [MODEL_DIR, *extra_writers], overwrite=overwrite)
    with discard_on_error(staging):
        dist_checkpointing.save(model_sharded_state_dict(chunks), str(staging / MODEL_DIR))
        for name, writer in extra_writers.items():
            writer(staging / name)
    dtype = next(unwrap(chunks[0]).parameters()).dtype
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    meta = {
        "arch": arch_to_meta(arch),
        "dtype": DTYPE_NAMES.get(dtype, str(dtype)),
        "saved_layout": {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": vpp,
        },
        "contents": [MODEL_DIR, HF_DIR, *extra_writers],
        "hf_lm_head_stored": on_rank0(lambda: source_stores_tied_lm_head(hf_dir, arch)),
        "source": str(hf_dir),
        **(extra_meta or {}),
    }
    finish_save(staging, ckpt_dir, hf_dir=hf_dir, meta=meta, overwrite=overwrite)
    return Path(ckpt_dir)


def verify_checkpoint(ckpt_dir: str | Path, *, hashes: bool = True) -> dict:
    """Collective: rank 0 checks the manifest (names any bad file) and meta.json; returns the meta."""

    def check():
        verify_manifest(ckpt_dir, hashes=hashes)
        return read_meta(ckpt_dir)

    return on_rank0(check)


@torch.no_grad()
def load_checkpoint(
    ckpt_dir: str | Path,
    chunks: list,
    arch: ModelArch,
    *,
    verify: bool = True,
    skip_prefix: str = "",
    model_dir: str = MODEL_DIR,
) -> dict:
    """Collective: load a checkpoint's weights into this rank's chunks (any saved layout).

    Verifies the manifest first (`verify=False` checks sizes only). `skip_prefix`: parameters
    under it are neither read nor required (a critic loading an actor's checkpoint keeps its own
    value head, `output_layer.`); every other one must be loaded. `model_dir`: the folder of the
    weights inside the checkpoint. Returns meta.json.
    """
    from megatron.core import dist_checkpointing

    meta = verify_checkpoint(ckpt_dir, hashes=verify)
    check_arch(meta, arch, str(ckpt_dir))
    sharded = model_sharded_state_dict(chunks)
    if skip_prefix:
        sharded = {
            c: {k: v for k, v in d.items() if not k.startswith(skip_prefix)} for c, d in sharded.items()
        }
    loaded = dist_checkpointing.load(sharded, str(Path(ckpt_dir) / model_dir))
    for i, chunk in enumerate(chunks):
        result = unwrap(chunk).load_state_dict(loaded[f"chunk{i}"], strict=not skip_prefix)
        if skip_prefix and (
            result.unexpected_keys or [k for k in result.missing_keys if not k.startswith(skip_prefix)]
        ):
            raise RuntimeError(
                f"{ckpt_dir}: loading chunk {i} left {result.missing_keys} missing and "
                f"{result.unexpected_keys} unexpected (only {skip_prefix}* may be missing)"
            )
    return meta
