"""Disjoint cores for an async run's engines and Megatron ranks on CPU (platform/cpus.py)."""

import pytest

from megatron_agent.platform.cpus import core_set_of, encode_core_sets, split_cores


@pytest.mark.parametrize(
    "cores, engines, ranks, want",
    [
        ([0, 1], 1, 1, ([[0]], [[1]])),
        ([0, 1, 2, 3], 1, 1, ([[0, 1]], [[2, 3]])),
        ([0, 1, 2, 3, 4, 5, 6, 7], 2, 2, ([[0, 1], [2, 3]], [[4, 5], [6, 7]])),
        ([0, 1, 2], 1, 2, ([[0]], [[1], [2]])),  # the ranks keep one core each
        ([4, 5, 6, 7], 1, 1, ([[4, 5]], [[6, 7]])),  # the cores this process may use
    ],
)
def test_every_process_gets_its_own_cores(cores, engines, ranks, want):
    got = split_cores(cores, engines, ranks)
    assert got == want
    flat = [c for group in got for part in group for c in part]
    assert len(flat) == len(set(flat))  # disjoint


def test_too_few_cores_share_as_a_sync_run_does():
    assert split_cores([0], 1, 1) is None and split_cores([0, 1], 2, 1) is None


def test_each_rank_reads_its_own_set_from_the_environment():
    env = {"MEGATRON_AGENT_CORE_SETS": encode_core_sets([[0, 1], [2, 3]])}
    assert core_set_of(1, env) == [2, 3] and core_set_of(0, env) == [0, 1]
    assert core_set_of(0, {}) is None
