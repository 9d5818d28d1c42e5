"""Built-in tools and the factory that builds a `ToolSet` from names or dotted paths."""

from __future__ import annotations

from megatron_agent.config.schema import BUILTIN_TOOLS
from megatron_agent.envs.registry import load_object
from megatron_agent.envs.tools.base import Tool, ToolResult, ToolSet, validate_arguments
from megatron_agent.envs.tools.calculator import Calculator
from megatron_agent.envs.tools.python import PATH_CODES
from megatron_agent.errors import InputError


def make_tool(
    spec: str,
    *,
    search_index_dir: str = "",
    search_top_k: int = 3,
    python_memory_mb: int = 512,
    python_sandbox: str = "auto",
    python_max_processes: int = 8,
    python_tmp_mb: int = 64,
    max_concurrent: int = 0,
    python_copies: int = 1,
    timeout_s: float = 10.0,
) -> Tool:
    """A tool from a built-in name or a dotted path to a `Tool` subclass (built with no arguments),
    a `Tool` instance, or a zero-argument factory returning one. `python_*`: the python tool's
    sandbox mode (auto, strict, off), memory budget per call in MiB, process limit and working
    folder size; `max_concurrent` (tools.max_concurrent): its calls at once (0: derived);
    `python_copies`: python tools on this machine (one per local engine), which share it;
    `timeout_s` (tools.timeout_s): its wall-clock limit, which kills its whole process tree."""
    if spec == "calculator":
        return Calculator()
    if spec == "search":
        from megatron_agent.envs.tools.search import Search

        if not search_index_dir:
            raise InputError(
                "the search tool needs tools.search_index_dir (build it with build_search_index)"
            )
        return Search(search_index_dir, top_k=search_top_k)
    if spec == "python":
        from megatron_agent.envs.tools.python import Python

        return Python(
            timeout_s=timeout_s,
            memory_mb=python_memory_mb,
            sandbox=python_sandbox,
            max_processes=python_max_processes,
            tmp_mb=python_tmp_mb,
            max_concurrent=max_concurrent,
            copies=python_copies,
        )
    if "." not in spec and ":" not in spec:
        raise InputError(f"unknown tool {spec!r}: use one of {BUILTIN_TOOLS} or a dotted path to a Tool")
    obj = load_object(spec)
    try:
        tool = obj() if callable(obj) and not isinstance(obj, Tool) else obj
    except TypeError as exc:
        raise InputError(f"{spec!r} cannot be built with no arguments: {exc}") from None
    if not isinstance(tool, Tool):
        raise InputError(
            f"{spec!r} did not give a megatron_agent.envs.tools.Tool (got {type(tool).__name__})"
        )
    return tool


MERGE_RULES = {
    "tool/unsandboxed": sum,
    "tool/sandboxed": min,
    "tool/sandbox_path": min,
    "tool/python_oom_kills": sum,
    "tool/python_peak_mb": max,
    "tool/python_wait_s": max,
}
"""How the engines' `sandbox_metrics` combine into a step's: counts add up, the weakest sandbox
and the largest peak or wait win."""


def sandbox_metrics(tools: ToolSet) -> dict[str, float]:
    """The sandbox's metrics since the previous call (one value per step; empty when no tool of
    the set runs untrusted code): `tool/unsandboxed` (calls run without a sandbox: `off`),
    `tool/sandboxed` (1.0 when every such tool is sandboxed), `tool/sandbox_path` (the weakest
    path: 2 bubblewrap with a cgroup per call, 1 bubblewrap with per-process limits, 0 none),
    `tool/python_oom_kills` (calls with a process killed at the memory budget),
    `tool/python_peak_mb` (the most memory one call held, cgroup path) and `tool/python_wait_s`
    (the longest wait for a free slot, `tools.max_concurrent`)."""
    counting = [t for t in tools.tools.values() if hasattr(t, "num_unsandboxed_calls")]
    if not counting:
        return {}
    out = {key: 0.0 for key in MERGE_RULES}
    for tool in counting:
        out["tool/unsandboxed"] += tool.num_unsandboxed_calls - getattr(tool, "_reported_unsandboxed", 0)
        out["tool/python_oom_kills"] += tool.num_oom_kills - getattr(tool, "_reported_oom_kills", 0)
        tool._reported_unsandboxed, tool._reported_oom_kills = tool.num_unsandboxed_calls, tool.num_oom_kills
        out["tool/python_peak_mb"] = max(out["tool/python_peak_mb"], tool.max_peak_bytes / 2**20)
        out["tool/python_wait_s"] = max(out["tool/python_wait_s"], tool.max_wait_s)
        tool.max_peak_bytes, tool.max_wait_s = 0, 0.0
    out["tool/sandboxed"] = float(all(t.sandboxed for t in counting))
    out["tool/sandbox_path"] = min(PATH_CODES[t.path] for t in counting)
    return out


def merge_tool_metrics(per_engine: list[dict[str, float]]) -> dict[str, float]:
    """The engines' `sandbox_metrics` as one (`MERGE_RULES`)."""
    merged: dict[str, float] = {}
    for key, rule in MERGE_RULES.items():
        values = [m[key] for m in per_engine if key in m]
        if values:
            merged[key] = float(rule(values))
    return merged


__all__ = [
    "BUILTIN_TOOLS",
    "Calculator",
    "Tool",
    "ToolResult",
    "ToolSet",
    "make_tool",
    "merge_tool_metrics",
    "sandbox_metrics",
    "validate_arguments",
]
