"""Cores shared between a rollout engine and the Megatron ranks of its machine (platform/core_sharing.py).

- the engine's byte, written in one process, is read in another through /proc (the way a rank
  reads it); another machine's engine, an engine whose process is gone and a file of its that is
  not the byte (a pid or fd reused) are not watched;
- `ThreadSharing` sets torch's threads when each hooked layer's forward and backward begins: half
  of them while the engine generates, all of them otherwise; the hooks leave the values and the
  gradients unchanged, and `close` removes them;
- (tests/rollout/test_agent_loop.py: the pump of a real vLLM engine says it is busy while it takes
  steps, and idle once done.)
"""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from megatron_agent.platform.core_sharing import ActivityHandle, ActivityWatch, EngineActivity, ThreadSharing

ENGINE = """
import dataclasses, json, sys
from megatron_agent.platform.core_sharing import EngineActivity
activity = EngineActivity("node-a")
print(json.dumps(dataclasses.asdict(activity.handle())), flush=True)
for line in sys.stdin:
    activity.set_busy(line.strip() == "busy")
    print("ok", flush=True)
"""


@pytest.fixture
def engine_process():
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    handle = ActivityHandle(**json.loads(proc.stdout.readline()))

    def say(state: str) -> None:
        proc.stdin.write(state + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"

    yield proc, handle, say
    proc.kill()
    proc.wait()


def test_a_rank_reads_the_engine_process_byte(engine_process):
    proc, handle, say = engine_process
    watch = ActivityWatch([handle, None], node="node-a")
    assert len(watch) == 1 and not watch.any_busy()
    say("busy")
    assert watch.any_busy()
    say("idle")
    assert not watch.any_busy()
    assert len(ActivityWatch([handle], node="node-b")) == 0  # another machine's cores
    stdin = dataclasses.replace(
        handle, fd=0
    )  # the engine's pid with another of its files: not an activity byte
    assert len(ActivityWatch([stdin], node="node-a")) == 0
    watch.close()


def test_an_engine_whose_process_is_gone_is_not_watched(engine_process, caplog):
    proc, handle, _ = engine_process
    proc.kill()
    proc.wait()
    watch = ActivityWatch([handle], node="node-a")
    assert len(watch) == 0 and not watch.any_busy()
    assert f"pid {handle.pid}" in caplog.text


class Recorder(torch.nn.Module):
    """A layer that records torch's threads in its forward and its backward."""

    def __init__(self, seen: list):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.seen = seen

    def forward(self, x):
        return _Record.apply(self.linear(x), self.seen)


class _Record(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seen):
        seen.append(("forward", torch.get_num_threads()))
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(("backward", torch.get_num_threads()))
        return grad, None


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _pass(layers, seen):
    seen.clear()
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    y = layers(x)
    y.square().sum().backward()
    return y.detach(), x.grad.clone(), list(seen)


def test_threads_follow_the_engine_in_forward_and_backward(two_threads):
    engine = EngineActivity("n")
    seen: list = []
    torch.manual_seed(1)
    layers = torch.nn.Sequential(Recorder(seen), Recorder(seen))
    plain = _pass(layers, seen)
    sharing = ThreadSharing(ActivityWatch([engine.handle()], node="n"), high=2)
    sharing.install(layers)

    engine.set_busy(True)
    y, grad, busy = _pass(layers, seen)
    assert busy == [("forward", 1)] * 2 + [("backward", 1)] * 2
    assert torch.equal(y, plain[0]) and torch.equal(grad, plain[1])  # values and gradients unchanged
    assert sharing.low_share() == 1.0  # two forward and two backward checks, all busy

    engine.set_busy(False)
    assert _pass(layers, seen)[2] == [("forward", 2)] * 2 + [("backward", 2)] * 2
    assert sharing.low_share() == 0.0

    # the engine starts generating between the forward and the backward
    engine.set_busy(False)
    seen.clear()
    out = layers(torch.randn(4, 8, requires_grad=True))
    engine.set_busy(True)
    out.sum().backward()
    assert seen == [("forward", 2)] * 2 + [("backward", 1)] * 2
    sharing.restore()
    assert torch.get_num_threads() == 2

    engine.set_busy(True)
    sharing.close()  # the hooks are gone: the threads no longer follow the engine
    assert _pass(layers, seen)[2] == [("forward", 2)] * 2 + [("backward", 2)] * 2
    engine.close()
