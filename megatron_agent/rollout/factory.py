"""Build the rollout pieces (engine, tools, agent loop) from the typed config.

The agent loop and the engines (torch, vLLM) are imported where they are built: the driver
builds its toolset here (to measure prompts with their tool schemas) before its workers start."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_agent.config import Config
from megatron_agent.envs.tools import ToolSet, make_tool
from megatron_agent.rollout.chat import ChatFormat

if TYPE_CHECKING:
    from megatron_agent.rollout.agent_loop import AgentLoop, AgentLoopConfig

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


KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MIN_KV_CACHE_BYTES = 16 << 20


def kv_cache_bytes(cfg: Config, model_path: str) -> int:
    """The KV cache of one CPU engine: `rollout.kv_cache_memory_bytes`, or when that is 0 what the
    trajectories one engine holds at once need at full length: min(`rollout.max_in_flight`,
    one batch's trajectories (`data.train_batch_size` x `rollout.n`, x (eta + 1) in async mode,
    where that many batches may generate at once)) / `rollout.num_engines`, each of
    `rollout.max_total_tokens` tokens, at layers x 2 x KV heads x head dim x dtype bytes per token,
    plus a quarter for vLLM's block rounding (at least 16 MiB). More trajectories than that
    (a large validation set) are queued or preempted by vLLM, not refused. The cache is memory
    written at the engine's start: the quickstart needs 80 MiB of it, not 256."""
    r = cfg.rollout
    if r.kv_cache_memory_bytes:
        return r.kv_cache_memory_bytes
    from megatron_agent.models.hf_config import arch_from_hf_config, load_hf_config

    arch = arch_from_hf_config(load_hf_config(model_path))
    per_token = arch.num_layers * 2 * arch.num_query_groups * arch.head_dim * KV_DTYPE_BYTES[cfg.model.dtype]
    stages = cfg.async_.max_staleness + 1 if cfg.trainer.mode == "async" else 1
    trajectories = min(r.max_in_flight, cfg.data.train_batch_size * r.n * stages)
    per_engine = -(-trajectories // r.num_engines)
    return max(MIN_KV_CACHE_BYTES, per_engine * r.max_total_tokens * per_token * 5 // 4)


def build_engine(cfg: Config, model_path: str, cache_dir: str | None = None, logits_processors=()):
    """The rollout engine named by `cfg.rollout.engine` on the HF folder `model_path` (vLLM gets
    the V1 `logits_processors` classes, e.g. for a scripted first turn)."""
    kwargs = engine_kwargs(cfg, cache_dir, logits_processors)
    if cfg.rollout.engine == "vllm":
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(cfg, model_path)
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
    configured timeout; the search index is `search_index_dir` or `cfg.tools.search_index_dir`.
    On a local cluster (no `ray.address`) all `rollout.num_engines` engines share this machine,
    and so do their python tools' memory and cores."""
    copies = 1 if cfg.ray.address else cfg.rollout.num_engines
    tools = [
        make_tool(
            name,
            search_index_dir=search_index_dir or cfg.tools.search_index_dir,
            search_top_k=cfg.tools.search_top_k,
            python_memory_mb=cfg.tools.python.memory_mb,
            python_sandbox=cfg.tools.python.sandbox,
            python_max_processes=cfg.tools.python.max_processes,
            python_tmp_mb=cfg.tools.python.tmp_mb,
            max_concurrent=cfg.tools.max_concurrent,
            python_copies=copies,
            timeout_s=cfg.tools.timeout_s,
        )
        for name in (cfg.tools.enabled if names is None else names)
    ]
    return ToolSet(tools, timeout_s=cfg.tools.timeout_s)


def agent_loop_config(cfg: Config) -> AgentLoopConfig:
    """`AgentLoopConfig` from the rollout and tools sections."""
    from megatron_agent.rollout.agent_loop import AgentLoopConfig

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
    from megatron_agent.rollout.agent_loop import AgentLoop
    from megatron_agent.rollout.async_engine import AsyncEngine

    return AgentLoop(
        AsyncEngine(engine), ChatFormat(engine.tokenizer), tools, agent_loop_config(cfg), turn_hook
    )
