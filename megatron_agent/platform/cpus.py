"""Disjoint CPU cores for the rollout engines and the Megatron ranks of an async run on CPU.

In a synchronous step the engines and the trainer take turns, so each may use every core. In an
async run they compute at the same time; sharing the cores, each then runs at about half speed
and the overlap buys nothing (docs/async.md, measured). `split_cores` gives the engines the
first half of the cores and the Megatron ranks the second half, each process its own slice; a
process applies its slice with `apply_core_set` (affinity and thread count) before it builds a
model. `MEGATRON_AGENT_CORE_SETS` carries the slices to the workers ('0,1|2,3': one per rank).
"""

from __future__ import annotations

import os

CORE_SETS_ENV = "MEGATRON_AGENT_CORE_SETS"


def available_cores() -> list[int]:
    """The cores this process may run on."""
    return (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )


def split_cores(
    cores: list[int], num_engines: int, num_ranks: int
) -> tuple[list[list[int]], list[list[int]]] | None:
    """(a core list per engine, a core list per Megatron rank), disjoint, or None when there are
    fewer cores than processes (then they share, as in a sync run)."""
    if len(cores) < num_engines + num_ranks:
        return None
    half = max(num_engines, min(len(cores) - num_ranks, len(cores) // 2))
    return _slices(cores[:half], num_engines), _slices(cores[half:], num_ranks)


def _slices(cores: list[int], parts: int) -> list[list[int]]:
    size = len(cores) // parts
    return [cores[i * size : (i + 1) * size] for i in range(parts)]


def encode_core_sets(sets: list[list[int]]) -> str:
    """The `MEGATRON_AGENT_CORE_SETS` value of per-rank core lists."""
    return "|".join(",".join(str(c) for c in cores) for cores in sets)


def core_set_of(rank: int, environ: dict | None = None) -> list[int] | None:
    """This rank's cores from `MEGATRON_AGENT_CORE_SETS` (None: not set)."""
    value = (os.environ if environ is None else environ).get(CORE_SETS_ENV, "")
    if not value:
        return None
    return [int(c) for c in value.split("|")[rank].split(",")]


def apply_core_set(rank: int) -> list[int] | None:
    """Pin this process to its rank's cores and size torch's threads to them; returns the cores."""
    import torch

    cores = core_set_of(rank)
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    return cores
