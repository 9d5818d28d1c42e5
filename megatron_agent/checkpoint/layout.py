"""The folder layout of a megatron-agent checkpoint, its metadata and atomic publication.

```
<ckpt>/
  model/          Megatron distributed checkpoint (torch_dist) of the model weights
  hf/             the source's config.json, tokenizer files and generation config
  meta.json       format version, architecture, dtype, saved layout, what the folder contains
  manifest.json   size and sha256 of every other file (written last)
```
Trainer state (optimizer, scheduler, data position, RNG) goes into further sub-folders named in
`meta.json["contents"]`. A checkpoint is written into a hidden temporary folder next to its
destination and renamed into place only when complete, so a crash never leaves a half-written
checkpoint under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

MODEL_DIR = "model"
HF_DIR = "hf"
META = "meta.json"
FORMAT = "megatron-agent-checkpoint"
FORMAT_VERSION = 1

# Files of an HF model folder that are weights (everything else at the top level is copied).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def hf_side_files(hf_dir: str | Path) -> list[Path]:
    """The non-weight top-level files of an HF folder: config, tokenizer, generation config, ..."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir / 'config.json'} not found: not an HF model folder")
    return sorted(
        p
        for p in hf_dir.iterdir()
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name not in _WEIGHT_INDEXES
    )


def copy_hf_side_files(hf_dir: str | Path, dest: str | Path) -> list[str]:
    """Copy `hf_side_files(hf_dir)` into `dest` (created); returns the copied names."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for p in hf_side_files(hf_dir):
        shutil.copy2(p, dest / p.name)
        names.append(p.name)
    return names


def write_meta(ckpt_dir: str | Path, meta: dict) -> None:
    """Write `meta.json` (the format fields are added)."""
    full = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    full.update(meta)
    (Path(ckpt_dir) / META).write_text(json.dumps(full, indent=1, sort_keys=True))


def read_meta(ckpt_dir: str | Path) -> dict:
    """Read and check `meta.json` of a checkpoint folder."""
    path = Path(ckpt_dir) / META
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {ckpt_dir} is not a megatron-agent checkpoint")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {meta['format_version']} is newer than this code reads ({FORMAT_VERSION})"
        )
    return meta


def staging_dir(final: str | Path) -> Path:
    """A fresh hidden folder next to `final` to write a checkpoint into (not created)."""
    final = Path(final)
    return final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"


def publish(staging: Path, final: str | Path, *, overwrite: bool = False) -> None:
    """Rename a complete staging folder to `final` (replacing an existing one if `overwrite`)."""
    final = Path(final)
    old = None
    if final.exists():
        if not overwrite:
            raise FileExistsError(f"{final} exists; remove it or pass overwrite=True (--overwrite)")
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
