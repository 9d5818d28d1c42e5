"""An engine process on CPU starts with malloc on huge pages (glibc reads its tunables at exec, so
the variable must be in the environment the process starts with, not set inside it) and with
torch.compile off (vLLM's compiled sampler helpers cost seconds at the first request)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_agent.rollout.engine_env import HUGE_PAGE_TUNABLE, engine_process_env, huge_pages_env
from megatron_agent.sync import SubprocessEndpoint

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU engine's environment")


class IdleEngine:
    """Just enough of an engine for `info` (no model)."""

    def __init__(self, model_path):
        self.weight_version = 0


def test_tunable_is_added_and_a_users_setting_wins():
    assert huge_pages_env({}) == {"GLIBC_TUNABLES": HUGE_PAGE_TUNABLE}
    merged = huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert merged == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGE_TUNABLE}"}
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}


def test_engine_env_adds_dynamo_off_and_a_users_setting_wins():
    assert engine_process_env({}) == {"GLIBC_TUNABLES": HUGE_PAGE_TUNABLE, "TORCHDYNAMO_DISABLE": "1"}
    assert engine_process_env({"TORCHDYNAMO_DISABLE": "0", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}


def test_subprocess_engine_starts_with_the_tunable_and_the_parent_env_is_unchanged():
    before = os.environ.get("GLIBC_TUNABLES")
    ep = SubprocessEndpoint("unused", {}, env={"OMP_NUM_THREADS": "1"}, engine_class=f"{__name__}:IdleEngine")
    try:
        assert ep.call("info").result(30)["pid"] == ep.pid
        with open(f"/proc/{ep.pid}/environ", "rb") as f:
            start_env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        assert HUGE_PAGE_TUNABLE.encode() in start_env.get(b"GLIBC_TUNABLES", b"")
        assert start_env.get(b"OMP_NUM_THREADS") == b"1", "the caller's env must be there from the start too"
    finally:
        ep.close()
    assert os.environ.get("GLIBC_TUNABLES") == before
