"""`deferred_torch_compile`: `torch.compile` of a plain function compiles at the function's first
call, with the options it was given, and computes what the function computes; modules compile at
once; outside the block `torch.compile` is torch's own. And a CPU rank's megatron-core import
(`parallel.import_megatron_core`) leaves Inductor's compiler unimported."""

from __future__ import annotations

import textwrap

import torch

from megatron_agent.platform.deferred_compile import deferred_torch_compile
from tests.conftest import fresh_python


class RecordingBackend:
    """A torch.compile backend that records each graph it compiles and runs it eagerly."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


def scaled_tanh(x):
    return torch.tanh(x) * 2.0 + 1.0


def test_a_function_compiles_at_its_first_call_and_computes_the_same():
    backend = RecordingBackend()
    original = torch.compile
    with deferred_torch_compile():
        assert torch.compile is not original
        fused = torch.compile(scaled_tanh, backend=backend, dynamic=False)
        decorated = torch.compile(backend=backend)(scaled_tanh)  # the decorator form
    assert torch.compile is original
    assert backend.graphs == 0  # nothing compiled while the library imports
    assert fused.__name__ == "scaled_tanh" and fused.__wrapped__ is scaled_tanh
    x = torch.linspace(-2, 2, 7)
    torch.testing.assert_close(fused(x), scaled_tanh(x), rtol=0, atol=0)
    assert backend.graphs == 1  # compiled by torch.compile, with its options, at the first call
    torch.testing.assert_close(fused(x + 1), scaled_tanh(x + 1), rtol=0, atol=0)
    assert backend.graphs == 1  # and reused
    torch.testing.assert_close(decorated(x), scaled_tanh(x), rtol=0, atol=0)
    assert backend.graphs == 2


def test_a_module_compiles_at_once_and_disabled_changes_nothing():
    with deferred_torch_compile():
        compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert type(compiled).__name__ == "OptimizedModule"
    original = torch.compile
    with deferred_torch_compile(enabled=False):
        assert torch.compile is original


def test_a_cpu_ranks_megatron_import_leaves_inductors_compiler_out():
    code = textwrap.dedent(
        """
        import json, sys
        from megatron_agent.platform.parallel import import_megatron_core
        import_megatron_core()
        from megatron.core.fusions.fused_bias_swiglu import swiglu  # a kernel under @jit_fuser
        print(json.dumps({
            "compiler": "torch._inductor.compile_fx" in sys.modules,
            "set_up": "_torchdynamo_orig_callable" in vars(swiglu),  # what torch.compile returns has it
            "wraps": swiglu.__wrapped__.__name__,
        }))
        """
    )
    report = fresh_python(code)
    assert report == {"compiler": False, "set_up": False, "wraps": "swiglu"}, report
