"""Run megatron-core on a machine without CUDA by redirecting its hard-coded CUDA calls to the CPU.

megatron-core 0.19 allocates pipeline buffers, grad buffers and scalars with `device="cuda"` or
`torch.cuda.current_device()`, seeds its tensor-parallel RNG tracker through `torch.cuda`
RNG functions, synchronises with `torch.cuda.synchronize()`, and asserts that parameters are
`torch.cuda.*Tensor`. No configuration flag avoids these. On a CPU-only machine we:

1. push a `TorchFunctionMode` that maps every CUDA device argument (a "cuda" string, a CUDA
   `torch.device`, or an integer ordinal) to the CPU and makes `Tensor.cuda()` a no-op;
2. replace the few `torch.cuda` functions megatron calls (current device, streams, synchronize,
   RNG state) with CPU equivalents, and megatron's private CUDA RNG helpers with the CPU RNG;
3. report `Tensor.type()` of CPU tensors with the `torch.cuda.` prefix megatron's optimizer
   asserts expect (the dtype part is unchanged).

`enable()` refuses to run where CUDA is available: nothing is ever patched on a GPU machine.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE_MODE: TorchFunctionMode | None = None


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare ordinal means a CUDA device in torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuStream:
    """Stand-in for `torch.cuda.Stream`: CPU work is synchronous, so every operation is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event

    def synchronize(self):
        pass

    def query(self):
        return True


def _get_cpu_rng_state(device=None, clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def enable() -> None:
    """Apply the CPU redirection once per process. Raises where CUDA is available."""
    global _ACTIVE_MODE
    if _ACTIVE_MODE is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cuda_on_cpu.enable() must never run on a machine with CUDA")

    # Import megatron and torch._dynamo (which indexes torch.cuda's functions) before anything is
    # replaced; each replacement is its own function object for the same reason. megatron-core no
    # longer imports torch._dynamo itself here (its torch.compile calls are deferred).
    from megatron_agent.platform.parallel import import_megatron_core

    import_megatron_core()
    importlib.import_module("torch._dynamo")
    from megatron.core.tensor_parallel import random as tp_random

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _CpuStream
    cuda.current_stream = lambda device=None: _CpuStream()
    cuda.default_stream = lambda device=None: _CpuStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0

    tp_random._get_cuda_rng_state = _get_cpu_rng_state
    tp_random._set_cuda_rng_state = _set_cpu_rng_state
    # A call the mode itself handles (autograd's backward, an autograd Function's apply) runs
    # with the mode popped, so activation recomputation (model.recompute) re-runs layers without
    # the redirection; the causal mask is the one CUDA literal on that path.
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = functools.lru_cache(maxsize=32)(
        lambda sq: torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()
    )

    mode = _CudaToCpuMode()
    mode.__enter__()  # stays pushed for the life of the process
    _ACTIVE_MODE = mode


def is_enabled() -> bool:
    """Whether the CPU redirection is active in this process."""
    return _ACTIVE_MODE is not None
