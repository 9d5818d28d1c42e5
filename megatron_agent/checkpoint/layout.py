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
destination and renamed into place only when complete (`weights.folders.staging_dir` and
`publish`), so a crash never leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from megatron_agent.weights.folders import hf_side_files

MODEL_DIR = "model"
HF_DIR = "hf"
META = "meta.json"
FORMAT = "megatron-agent-checkpoint"
FORMAT_VERSION = 1


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
