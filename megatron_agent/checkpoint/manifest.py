"""Per-file checksums of a checkpoint folder, written with every checkpoint and checked on load.

`manifest.json` lists every file of the checkpoint (relative path, size in bytes, sha256). A
missing, truncated or altered file fails verification with an error that names the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_agent.errors import InputError

MANIFEST = "manifest.json"
_CHUNK = 1 << 22


class CheckpointIntegrityError(InputError):
    """A checkpoint file is missing, truncated or altered (or the manifest itself is absent)."""


def sha256_file(path: Path, *, fsync: bool = False) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks (`fsync`: also flush it to disk)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_CHUNK):
            digest.update(block)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _num_workers(limit: int = 8) -> int:
    """Hashing threads: up to 8, one per core (hashlib, reads and fsync release the GIL)."""
    return max(1, min(limit, os.cpu_count() or 1))


def _hash_all(paths: list[Path], *, fsync: bool = False) -> list[str]:
    """sha256 of many files on a few threads."""
    with ThreadPoolExecutor(_num_workers(max(len(paths), 1))) as pool:
        return list(pool.map(lambda p: sha256_file(p, fsync=fsync), paths))


class BackgroundHasher:
    """Hash (and fsync) files on worker threads as soon as their writer closes them.

    Use as a context manager (the workers stop on exit). A writer calls `submit(path)` for each
    finished file and goes on writing the next one, so hashing overlaps writing instead of
    following it; `digests(root)` waits for the workers and returns {path relative to root:
    sha256} for `write_manifest(..., known=...)`. Files must not change after they are submitted.
    """

    def __init__(self, workers: int | None = None):
        self._pool = ThreadPoolExecutor(workers or _num_workers())
        self._futures: dict[Path, object] = {}

    def __enter__(self) -> BackgroundHasher:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, path: str | Path) -> None:
        """Start hashing and syncing the closed file `path`."""
        path = Path(path)
        self._futures[path] = self._pool.submit(sha256_file, path, fsync=True)

    def digests(self, root: str | Path) -> dict[str, str]:
        """Wait for every submitted file; their digests keyed by path relative to `root`."""
        return {str(p.relative_to(root)): f.result() for p, f in self._futures.items()}


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: str | Path, *, fsync: bool = True, known: dict[str, str] | None = None) -> dict:
    """Hash every file under `root` into `root/manifest.json`; returns the manifest.

    With `fsync` every file is also flushed to disk while it is hashed, so a checkpoint that
    has a manifest is durable (the writers themselves need not sync file by file). `known`
    maps relative paths to digests already computed (and synced) by a `BackgroundHasher`;
    those files are not read again.
    """
    root = Path(root)
    rels = {str(p.relative_to(root)): p for p in _files(root)}
    digests = {rel: known[rel] for rel in rels if known and rel in known}
    todo = [rel for rel in rels if rel not in digests]
    digests.update(zip(todo, _hash_all([rels[rel] for rel in todo], fsync=fsync)))
    files = {rel: {"size": p.stat().st_size, "sha256": digests[rel]} for rel, p in rels.items()}
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
        rels = list(files)
        for rel, digest in zip(rels, _hash_all([root / r for r in rels])):
            if digest != files[rel]["sha256"]:
                raise CheckpointIntegrityError(
                    f"checkpoint file altered: {root / rel} does not match its sha256 in {MANIFEST}"
                )
