"""HF model folders on disk: which top-level files are not weights, and atomic folder writes.

A folder (a checkpoint, an exported or quantized HF model) is written into a hidden folder next
to its destination (`staging_dir`) and renamed into place only when complete (`publish`), so a
crash never leaves a half-written folder under the final name.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

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


def staging_dir(final: str | Path) -> Path:
    """A fresh hidden folder next to `final` to write a folder into (not created)."""
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
