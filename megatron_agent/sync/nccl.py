"""NCCL weight transfer for disaggregated GPU engines: one broadcast per bucket.

Each sending actor rank forms its own small NCCL group with the workers of every engine
(sender rank 0, engine e's worker w at offset_e + w), built with vLLM's `StatelessProcessGroup`
and `PyNcclCommunicator` so that neither side's torch.distributed state is touched. A bucket is
announced to the engines (`load_bucket` with an `nccl` payload, which makes each worker post
the receive) and then broadcast; the stream is synchronised on both sides before the bytes are
read or the buffer reused (a broadcast that returns before the kernel finished corrupts weights).
The group lives as long as the sender: setting it up is the expensive part.
"""

from __future__ import annotations

import socket

import torch

from megatron_agent.sync.buckets import SyncError

# Communicators joined by this process (engine worker side), by group key.
_GROUPS: dict[str, object] = {}


def _communicator(host: str, port: int, rank: int, world_size: int):
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(pg, device=torch.device("cuda", torch.cuda.current_device()))


def join_on_worker(worker, host: str, port: int, rank_offset: int, world_size: int) -> None:
    """Run inside each vLLM worker: join the group of the sender at host:port."""
    _GROUPS[f"{host}:{port}"] = _communicator(host, port, rank_offset + int(worker.rank), world_size)


class _WorkerReceiver:
    def receive(self, payload: dict) -> torch.Tensor:
        comm = _GROUPS.get(payload["group"])
        if comm is None:
            raise SyncError(f"this engine worker never joined NCCL group {payload['group']}")
        buf = torch.empty(payload["nbytes"], dtype=torch.uint8, device=torch.cuda.current_device())
        stream = torch.cuda.current_stream()
        comm.broadcast(buf, src=0, stream=stream)
        stream.synchronize()
        return buf


def worker_group(worker) -> _WorkerReceiver | None:
    """The NCCL receive side for `open_bucket` (None where this process joined no group)."""
    return _WorkerReceiver() if _GROUPS else None


class NcclSender:
    """The sender's end of one NCCL group with the workers of all `endpoints`."""

    def __init__(self, endpoints: list, infos: list[dict], timeout_s: float):
        if not torch.cuda.is_available():
            raise SyncError("NCCL weight sync needs CUDA on the sending actor rank")
        host = socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        world_size = 1 + sum(int(i["num_workers"]) for i in infos)
        futures, offset = [], 1
        for ep, info in zip(endpoints, infos):
            futures.append(ep.call("init_nccl", host, port, offset, world_size))
            offset += int(info["num_workers"])
        self.key = f"{host}:{port}"
        self.comm = _communicator(host, port, 0, world_size)
        for f in futures:
            f.result(timeout_s)

    def payload(self, nbytes: int) -> dict:
        """The payload announcing a bucket of `nbytes` to the engines."""
        return {"kind": "nccl", "group": self.key, "nbytes": nbytes}

    def broadcast(self, u8: torch.Tensor) -> None:
        """Send the bucket bytes to every engine worker (returns once the kernel finished)."""
        stream = torch.cuda.current_stream()
        self.comm.broadcast(u8, src=0, stream=stream)
        stream.synchronize()
