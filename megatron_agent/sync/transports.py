"""How bucket bytes reach the engine: in-process memory, shared memory, CUDA IPC, NCCL.

Sender side, a `BucketBuffer` owns the bytes of one bucket and describes them to the engine with
a small picklable *payload* dict; the bucket's tensors are never pickled:

- `direct`:   an in-process uint8 tensor, handed over as the object itself (LocalEndpoint).
- `shm`:      a file in /dev/shm, mapped by both sides; the engine reads it in place.
- `cuda_ipc`: a CUDA allocation whose IPC handle the engine's workers open (same GPU host).
- `nccl`:     a CUDA buffer broadcast from the sender to the engine's workers (`sync.nccl`).

Engine side, `open_bucket` turns a payload back into a uint8 tensor (zero-copy except NCCL,
which receives into a fresh device buffer). A sender's shared-memory segment stays mapped
from one sync to the next while it is in use (`release_buckets`).
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import tempfile
import weakref

import torch

from megatron_agent.platform.run_token import current_token, token_alive
from megatron_agent.sync.buckets import SyncError

TRANSPORTS = ("direct", "shm", "cuda_ipc", "nccl")
_counter = itertools.count()


def host_id() -> str:
    """This machine's identity for 'same host' checks (hostname and boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shm_dir() -> str:
    """Folder for shared-memory bucket files (/dev/shm where it exists)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def choose_transport(requested: str, *, local: bool, engine_info: dict) -> str:
    """The transport for one endpoint: `requested` checked, or chosen when 'auto'.

    `local`: the engine lives in this process; `engine_info`: the receiver's `info()` (host,
    device). Raises ValueError naming the setting when the transport cannot work.
    """
    same_host = engine_info.get("host") == host_id()
    engine_cuda = engine_info.get("device") == "cuda"
    cuda = torch.cuda.is_available()
    if requested == "auto":
        if local:
            return "direct"
        if same_host and not (cuda and engine_cuda):
            return "shm"
        if cuda and engine_cuda:
            return "cuda_ipc" if same_host else "nccl"
        raise ValueError(
            f"no transport reaches the engine on {engine_info.get('host')} from {host_id()}: "
            "shared memory needs the same host, NCCL needs CUDA on both sides"
        )
    if requested not in TRANSPORTS:
        raise ValueError(f"sync.transport={requested!r}: choose auto, {', '.join(TRANSPORTS)}")
    if requested == "direct" and not local:
        raise ValueError("sync.transport=direct needs the engine in this process (a LocalEndpoint)")
    if requested == "shm" and not (same_host or local):
        raise ValueError("sync.transport=shm needs the engine on the same host; use nccl")
    if requested in ("cuda_ipc", "nccl") and not (cuda and engine_cuda):
        raise ValueError(f"sync.transport={requested} needs CUDA on the actor and the engine; use shm")
    if requested == "cuda_ipc" and not (same_host or local):
        raise ValueError("sync.transport=cuda_ipc needs the engine on the same host; use nccl")
    return requested


def buffer_device(transports: set[str]) -> str:
    """'cpu' or 'cuda': where the sender's bucket buffers live for a set of endpoint transports."""
    if transports & {"cuda_ipc", "nccl"}:
        if "shm" in transports:
            raise ValueError("mixing shm and CUDA transports across engines is not supported")
        return "cuda"
    if "direct" in transports and torch.cuda.is_available() and "shm" not in transports:
        return "cuda"
    return "cpu"


class BucketBuffer:
    """One bucket's bytes on the sender: CPU memory, a /dev/shm file, or CUDA memory."""

    def __init__(self, nbytes: int, *, shared: bool, device: str, attach: str | None = None):
        self.nbytes = nbytes
        self.path = None
        self._mmap = None
        self._owner = attach is None
        if attach is not None:  # a TP peer maps the sender's segment to write its shards into it
            self.path = attach
            self._mmap, _ = _map(attach, nbytes)
            self.u8 = torch.frombuffer(self._mmap, dtype=torch.uint8)
        elif device == "cuda":
            self.u8 = torch.empty(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
        elif shared:
            owner = "-".join(filter(None, (current_token(), str(os.getpid()))))  # the run's token first
            self.path = os.path.join(shm_dir(), f"{SEGMENT_PREFIX}{owner}-{next(_counter)}")
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
            finally:
                os.close(fd)
            self.u8 = torch.frombuffer(self._mmap, dtype=torch.uint8)
            # Unlinked by close(), or when the buffer is collected or the interpreter exits.
            self._unlink = weakref.finalize(self, _unlink_quietly, self.path)
        else:
            self.u8 = torch.empty(nbytes, dtype=torch.uint8)
        self._ipc = None

    def payload(self, transport: str, nbytes: int, offset: int = 0) -> dict:
        """What the engine needs to find `nbytes` of this buffer from `offset` (never the bytes themselves)."""
        if transport == "direct":
            return {"kind": "direct", "tensor": self.u8[offset : offset + nbytes]}
        if transport == "shm":
            return {
                "kind": "shm",
                "path": self.path,
                "nbytes": self.nbytes,
                "offset": offset,
                "length": nbytes,
            }
        if transport == "cuda_ipc":
            if self._ipc is None:
                from torch.multiprocessing.reductions import reduce_tensor

                self._ipc = reduce_tensor(self.u8)
            return {"kind": "cuda_ipc", "handle": self._ipc, "nbytes": nbytes}
        if transport == "nccl":
            return {"kind": "nccl", "nbytes": nbytes}
        raise AssertionError(transport)

    def close(self) -> None:
        """Free the bytes (unlink the shared-memory file)."""
        self.u8 = None
        self._ipc = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        if self.path is not None and self._owner:
            self._unlink()
        self.path = None


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map (and allocate) all pages at once: no page faults later
SEGMENT_PREFIX = "megatron-agent-sync-"


def _map(path: str, nbytes: int) -> tuple[mmap.mmap, int]:
    """A shared map of the file `path`, and the inode of the file it maps."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as e:
        raise SyncError(
            f"shared-memory bucket {path} does not exist (sender gone, or on another host?)"
        ) from e
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        return mm, os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_stale_segments() -> int:
    """Unlink bucket files left in shared memory by runs whose driver is gone (named with the run
    token: `platform/run_token.py`), or, for files without one, by sender processes that no
    longer exist; returns how many."""
    removed = 0
    for name in os.listdir(shm_dir()):
        if not name.startswith(SEGMENT_PREFIX):
            continue
        owner = name[len(SEGMENT_PREFIX) :].split("-", 1)[0]
        stale = (
            not token_alive(owner)
            if "." in owner
            else owner.isdigit() and not os.path.exists(f"/proc/{owner}")
        )
        if stale:
            try:
                os.unlink(os.path.join(shm_dir(), name))
                removed += 1
            except OSError:
                pass
    return removed


# ---- engine side -----------------------------------------------------------------------------


class _OpenMap:
    """An engine-side map of one sender's shared-memory segment, and which file it maps."""

    def __init__(self, path: str, nbytes: int):
        self.mm, self.inode = _map(path, nbytes)
        self.u8 = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.path, self.nbytes = path, nbytes

    def current(self) -> bool:
        """Whether the path still names the file this maps (not unlinked, not replaced)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False


# Engine side: the senders' segments stay mapped from one sync to the next. Mapping 512 MiB of
# populated shared memory costs 55-100 ms and unmapping it 18-29 ms on the benchmark machine, a
# third of a whole sync when it was done every time; the sender keeps its segment for the same
# reason. A map is reused only while the path still names the file it maps (same inode: a new
# segment can get an old name when a pid is reused). A kept map holds no memory of its own while
# its sender keeps the file; once the file is unlinked, the map is closed at the end of the next
# sync (`release_buckets`), so an old segment's pages are not kept alive by the engine.
_OPEN_MAPS: dict[str, _OpenMap] = {}
_MAX_OPEN_MAPS = 4


def open_bucket(payload: dict, *, nccl_group=None) -> torch.Tensor:
    """The bucket's bytes as a 1-D uint8 tensor on the engine side."""
    kind = payload["kind"]
    if kind == "direct":
        return payload["tensor"]
    if kind == "shm":
        path, nbytes = payload["path"], payload["nbytes"]
        entry = _OPEN_MAPS.get(path)
        if entry is not None and (entry.nbytes != nbytes or not entry.current()):
            _close(_OPEN_MAPS.pop(path))  # the name now belongs to another file
            entry = None
        if entry is None:
            entry = _OPEN_MAPS[path] = _OpenMap(path, nbytes)
            while len(_OPEN_MAPS) > _MAX_OPEN_MAPS:  # the oldest first
                _close(_OPEN_MAPS.pop(next(iter(_OPEN_MAPS))))
        offset = payload.get("offset", 0)
        return entry.u8[offset : offset + payload.get("length", nbytes)]
    if kind == "cuda_ipc":
        rebuild, args = payload["handle"]
        return rebuild(*args)[: payload["nbytes"]]
    if kind == "nccl":
        if nccl_group is None:
            raise SyncError("an NCCL bucket arrived but this engine joined no NCCL weight-sync group")
        return nccl_group.receive(payload)
    raise SyncError(f"unknown bucket payload kind {kind!r}")


def release_buckets(keep_live: bool = False) -> None:
    """End of a sync: close this process's shared-memory maps.

    `keep_live`: keep the maps whose file its sender still holds (the next sync reads the same
    segment) and close only those whose file was unlinked or replaced."""
    for path, entry in list(_OPEN_MAPS.items()):
        if not (keep_live and entry.current()):
            _close(_OPEN_MAPS.pop(path))


def _close(entry: _OpenMap) -> None:
    mm = entry.mm
    entry.u8 = entry.mm = None
    try:
        mm.close()
    except BufferError:
        pass  # a view is still referenced somewhere; the map is freed with it
