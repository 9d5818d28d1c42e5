"""Build the rollout pieces (engine, tools, agent loop) from the typed config."""

from __future__ import annotations

from megatron_agent.config import Config
from megatron_agent.envs.tools import ToolSet, make_tool
from megatron_agent.rollout.agent_loop import AgentLoop, AgentLoopConfig
from megatron_agent.rollout.async_engine import AsyncEngine
from megatron_agent.rollout.chat import ChatFormat

ENGINES = ("vllm", "hf")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def engine_kwargs(cfg: Config, cache_dir: str | None = None, logits_processors=()) -> dict:
    """Keyword arguments of the engine class of `cfg.rollout.engine` (besides the model folder)."""
    dtype = _DTYPES.get(cfg.model.dtype)
    if dtype is None:
        raise ValueError(f"model.dtype={cfg.model.dtype!r}: choose one of {sorted(_DTYPES)}")
    if cfg.rollout.engine == "vllm":
        return dict(
            dtype=dtype,
            tp=cfg.rollout.tp,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            kv_cache_memory_bytes=cfg.rollout.kv_cache_memory_bytes,
            enable_sleep_mode=cfg.rollout.enable_sleep_mode,
            seed=cfg.rollout.seed,
            cache_dir=cache_dir,
            quantization=cfg.rollout.quantization,
            fp8_scales=cfg.rollout.fp8_scales,
            logits_processors=logits_processors,
            keep_kv=cfg.async_.keep_kv,
        )
    if cfg.rollout.engine == "hf":
        if cfg.rollout.quantization:
            raise ValueError("rollout.quantization needs rollout.engine=vllm")
        return dict(dtype=dtype, seed=cfg.rollout.seed)
    raise ValueError(f"rollout.engine={cfg.rollout.engine!r}: choose one of {ENGINES}")


def build_engine(cfg: Config, model_path: str, cache_dir: str | None = None, logits_processors=()):
    """The rollout engine named by `cfg.rollout.engine` on the HF folder `model_path` (vLLM gets
    the V1 `logits_processors` classes, e.g. for a scripted first turn)."""
    kwargs = engine_kwargs(cfg, cache_dir, logits_processors)
    if cfg.rollout.engine == "vllm":
        from megatron_agent.rollout.engine import VLLMEngine

        return VLLMEngine(model_path, **kwargs)
    import logging

    from megatron_agent.rollout.hf_engine import HFEngine

    logging.getLogger(__name__).warning("rollout.engine=hf is a slow debugging aid; use vllm for real runs")
    return HFEngine(model_path, **kwargs)


def build_toolset(
    cfg: Config, names: list[str] | tuple[str, ...] | None = None, search_index_dir: str | None = None
) -> ToolSet:
    """Tools of `names` (default `cfg.tools.enabled`; a run passes `RunPlan.tools`), with the
    configured timeout; the search index is `search_index_dir` or `cfg.tools.search_index_dir`."""
    tools = [
        make_tool(
            name,
            search_index_dir=search_index_dir or cfg.tools.search_index_dir,
            search_top_k=cfg.tools.search_top_k,
            python_memory_mb=cfg.tools.python.memory_mb,
            python_sandbox=cfg.tools.python.sandbox,
            python_max_processes=cfg.tools.python.max_processes,
            timeout_s=cfg.tools.timeout_s,
        )
        for name in (cfg.tools.enabled if names is None else names)
    ]
    return ToolSet(tools, timeout_s=cfg.tools.timeout_s)


def agent_loop_config(cfg: Config) -> AgentLoopConfig:
    """`AgentLoopConfig` from the rollout and tools sections."""
    r, t = cfg.rollout, cfg.tools
    return AgentLoopConfig(
        max_new_tokens=r.max_new_tokens,
        max_turns=r.max_turns,
        max_total_tokens=r.max_total_tokens,
        max_trajectory_seconds=r.max_trajectory_seconds,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_at_tool_call=r.stop_at_tool_call,
        max_tool_response_tokens=t.max_tool_response_tokens,
        truncate_side=t.truncate_side,
        max_in_flight=r.max_in_flight,
        # Deterministic mode: per-request seeds and the lockstep schedule (docs/resume.md).
        seed=r.seed if cfg.trainer.deterministic else None,
        lockstep=cfg.trainer.deterministic,
    )


def build_agent_loop(cfg: Config, engine, tools: ToolSet, turn_hook=None) -> AgentLoop:
    """An `AgentLoop` over `engine` (wrapped in an `AsyncEngine`) with `tools`."""
    return AgentLoop(
        AsyncEngine(engine), ChatFormat(engine.tokenizer), tools, agent_loop_config(cfg), turn_hook
    )
