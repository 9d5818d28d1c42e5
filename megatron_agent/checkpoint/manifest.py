"""Per-file checksums of a checkpoint folder, written with every checkpoint and checked on load.

`manifest.json` lists every file of the checkpoint (relative path, size in bytes, sha256). A
missing, truncated or altered file fails verification with an error that names the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
_CHUNK = 1 << 22


class CheckpointIntegrityError(ValueError):
    """A checkpoint file is missing, truncated or altered (or the manifest itself is absent)."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: str | Path) -> dict:
    """Hash every file under `root` into `root/manifest.json`; returns the manifest."""
    root = Path(root)
    files = {
        str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in _files(root)
    }
    manifest = {"version": 1, "algorithm": "sha256", "files": files}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    tmp.replace(root / MANIFEST)
    return manifest


def verify_manifest(root: str | Path, *, hashes: bool = True) -> None:
    """Check every file listed in `root/manifest.json` (sizes first, then hashes).

    Raises `CheckpointIntegrityError` naming the first missing, truncated or altered file.
    `hashes=False` checks presence and sizes only (fast).
    """
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointIntegrityError(
            f"{path} not found: {root} is incomplete (an interrupted save) or not a megatron-agent checkpoint"
        )
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointIntegrityError(f"{path} is unreadable: {e}") from e
    for rel, entry in files.items():
        file = root / rel
        if not file.is_file():
            raise CheckpointIntegrityError(f"checkpoint file missing: {file}")
        size = file.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than recorded"
            raise CheckpointIntegrityError(
                f"checkpoint file {what}: {file} has {size} bytes, the manifest records {entry['size']}"
            )
    if hashes:
        for rel, entry in files.items():
            if sha256_file(root / rel) != entry["sha256"]:
                raise CheckpointIntegrityError(
                    f"checkpoint file altered: {root / rel} does not match its sha256 in {MANIFEST}"
                )
