"""The variables a CPU engine's process starts with, and what it hides while vLLM imports.

The driver reads these before it creates the engines' Ray workers (the variables must be set when
the process starts: glibc reads `GLIBC_TUNABLES` at exec), so this module imports neither torch
nor vLLM (`platform/accelerator.py` answers whether there is a GPU).
"""

from __future__ import annotations

import os

from megatron_agent.platform.accelerator import cuda_available

CPU_ENGINE_UNUSED_IMPORTS = ("triton", "scipy", "cv2")
"""Hidden while a CPU engine imports and builds vLLM (`platform/hidden_imports.py`): triton has
no CPU backend (vLLM disables it when it finds none), scipy serves transformers' object-detection
losses and OpenCV vLLM's video decoding. 150 MB of the engine's 860 (the quickstart's engine after
a rollout: 709 MB), none of it used by a text-only engine on CPU."""

NO_DYNAMO_UNUSED_IMPORTS = ("torch._inductor.lowering",)
"""Hidden as well where TorchDynamo is off (`TORCHDYNAMO_DISABLE=1`, which `engine_process_env`
gives a CPU engine): vLLM imports Inductor's lowerings as it imports (a guarded import) only to add
its own ops to Inductor's fallback list, for graphs that `torch.compile` then never compiles.
0.4-1.2 s of an engine's start on 2 cores (7.7-8.5 s -> 7.3 s for the quickstart's) and 40 MB."""

HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def cpu_engine_unused_imports(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """What a CPU engine's process hides while vLLM imports and builds: `CPU_ENGINE_UNUSED_IMPORTS`,
    and `NO_DYNAMO_UNUSED_IMPORTS` where `environ` (default: this process's) turns TorchDynamo off
    as torch reads it (`torch.compile` is then a no-op)."""
    environ = os.environ if environ is None else environ
    dynamo_off = environ.get("TORCHDYNAMO_DISABLE", "") == "1"
    return CPU_ENGINE_UNUSED_IMPORTS + (NO_DYNAMO_UNUSED_IMPORTS if dynamo_off else ())


def engine_process_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables a process that will run a vLLM engine on CPU must start with: `huge_pages_env`,
    and `TORCHDYNAMO_DISABLE=1`. vLLM compiles a few helpers with `torch.compile` even in eager
    mode (the sampler's log-prob gather): on CPU the compile ran at the engine's first request,
    2.4-2.7 s of the quickstart's first weight sync (its probe), for no measurable gain after
    (the probe: 2.68 s -> 0.03 s on its first call, 0.02 s -> 0.01 s after). Empty on GPU; a
    value the user set wins."""
    if cuda_available():
        return {}
    environ = os.environ if environ is None else environ
    env = huge_pages_env(environ)
    if "TORCHDYNAMO_DISABLE" not in environ:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def huge_pages_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`GLIBC_TUNABLES` for a CPU worker process (glibc reads it at exec).

    `glibc.malloc.hugetlb=1`: malloc's large blocks get transparent huge pages. vLLM on CPU keeps
    each linear weight as a oneDNN-packed copy in fresh memory, rebuilt at every weight load;
    on 4 KiB pages, faulting that memory in cost more than the repack itself (a 32000 x 768
    output layer: 57 ms on 4 KiB pages, 24 ms with huge pages; the weight sync benchmark's engine
    load 0.16-0.20 s -> 0.11-0.12 s). Not for the Megatron ranks: their update was 7% faster
    with it, but their forward differed between two processes in 1 of 5 runs (at 1e-7), and
    deterministic runs must repeat exactly. Empty on GPU, or when
    GLIBC_TUNABLES already sets it (the user's choice wins); older glibc ignores the tunable."""
    if cuda_available():
        return {}
    current = (os.environ if environ is None else environ).get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return {}
    return {"GLIBC_TUNABLES": ":".join(t for t in (current, HUGE_PAGE_TUNABLE) if t)}
