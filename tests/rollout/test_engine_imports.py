"""A CPU engine's process builds vLLM without the optional packages a text-only engine never uses
(`rollout.engine.CPU_ENGINE_UNUSED_IMPORTS`: triton, scipy, OpenCV), generates, and can still
import them afterwards."""

from __future__ import annotations

import textwrap

from tests.conftest import fresh_python

ENGINE = textwrap.dedent(
    """
    import json, sys
    from megatron_agent.rollout.engine import CPU_ENGINE_UNUSED_IMPORTS, SamplingConfig, VLLMEngine

    engine = VLLMEngine(sys.argv[1], dtype="float32", kv_cache_memory_bytes=32 * 1024 * 1024, seed=0)
    (out,) = engine.generate([[1, 2, 3, 4]], SamplingConfig(max_tokens=8, temperature=1.0))
    loaded = {name: name in sys.modules for name in CPU_ENGINE_UNUSED_IMPORTS}
    with open("/proc/self/maps") as maps:
        libtriton = "libtriton" in maps.read()
    import scipy.optimize  # a tool or reward may still use it

    print(json.dumps({"loaded": loaded, "libtriton": libtriton, "tokens": len(out[0].token_ids),
                      "scipy_after": scipy.optimize.__name__}))
    """
)


def test_a_cpu_engine_builds_and_generates_without_triton_scipy_and_opencv(tiny_model_dir):
    report = fresh_python(ENGINE, tiny_model_dir, env={"OMP_NUM_THREADS": "1"})
    assert report == {
        "loaded": {"triton": False, "scipy": False, "cv2": False},
        "libtriton": False,
        "tokens": 8,
        "scipy_after": "scipy.optimize",
    }, report
