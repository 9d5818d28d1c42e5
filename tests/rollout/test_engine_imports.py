"""A CPU engine's process builds vLLM without the optional packages a text-only engine never uses
(`rollout.engine_env.CPU_ENGINE_UNUSED_IMPORTS`: triton, scipy, OpenCV; and Inductor's lowerings where
TorchDynamo is off, as in a run's engines), generates, and can still import them afterwards."""

from __future__ import annotations

import textwrap

from megatron_agent.rollout.engine_env import (
    CPU_ENGINE_UNUSED_IMPORTS,
    cpu_engine_unused_imports,
    engine_process_env,
)
from tests.conftest import fresh_python

ENGINE = textwrap.dedent(
    """
    import json, sys
    from megatron_agent.rollout.engine import SamplingConfig, VLLMEngine
    from megatron_agent.rollout.engine_env import cpu_engine_unused_imports

    engine = VLLMEngine(sys.argv[1], dtype="float32", kv_cache_memory_bytes=32 * 1024 * 1024, seed=0)
    (out,) = engine.generate([[1, 2, 3, 4]], SamplingConfig(max_tokens=8, temperature=1.0))
    loaded = {name: name in sys.modules for name in cpu_engine_unused_imports()}
    with open("/proc/self/maps") as maps:
        libtriton = "libtriton" in maps.read()
    import scipy.optimize  # a tool or reward may still use it

    print(json.dumps({"loaded": loaded, "libtriton": libtriton, "tokens": len(out[0].token_ids),
                      "scipy_after": scipy.optimize.__name__}))
    """
)


def test_a_cpu_engine_builds_and_generates_without_triton_scipy_opencv_and_inductors_lowerings(
    tiny_model_dir,
):
    env = {"OMP_NUM_THREADS": "1", **engine_process_env({})}  # what a run's engine starts with
    report = fresh_python(ENGINE, tiny_model_dir, env=env)
    assert report == {
        "loaded": {"triton": False, "scipy": False, "cv2": False, "torch._inductor.lowering": False},
        "libtriton": False,
        "tokens": 8,
        "scipy_after": "scipy.optimize",
    }, report


def test_inductors_lowerings_are_hidden_only_where_dynamo_is_off():
    assert cpu_engine_unused_imports({}) == CPU_ENGINE_UNUSED_IMPORTS
    assert cpu_engine_unused_imports({"TORCHDYNAMO_DISABLE": "0"}) == CPU_ENGINE_UNUSED_IMPORTS
    hidden = cpu_engine_unused_imports({"TORCHDYNAMO_DISABLE": "1"})
    assert hidden == (*CPU_ENGINE_UNUSED_IMPORTS, "torch._inductor.lowering")
