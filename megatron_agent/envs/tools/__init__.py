"""Built-in tools and the factory that builds a `ToolSet` from names or dotted paths."""

from __future__ import annotations

from megatron_agent.config.schema import BUILTIN_TOOLS
from megatron_agent.envs.registry import load_object
from megatron_agent.envs.tools.base import Tool, ToolResult, ToolSet, validate_arguments
from megatron_agent.envs.tools.calculator import Calculator
from megatron_agent.errors import InputError


def make_tool(
    spec: str,
    *,
    search_index_dir: str = "",
    search_top_k: int = 3,
    python_memory_mb: int = 512,
    python_sandbox: str = "auto",
    python_max_processes: int = 16,
    timeout_s: float = 10.0,
) -> Tool:
    """A tool from a built-in name or a dotted path to a `Tool` subclass (built with no arguments),
    a `Tool` instance, or a zero-argument factory returning one. `python_*`: the python tool's
    sandbox mode (auto, strict, off), address-space limit in MiB and process limit; `timeout_s`
    (tools.timeout_s): the python tool's wall-clock limit, which kills its whole process tree."""
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


def sandbox_metrics(tools: ToolSet) -> dict[str, float]:
    """`tool/unsandboxed`: snippets run without a sandbox since the previous call (python tool in
    `auto` without bubblewrap, or `off`); `tool/sandboxed`: 1.0 when every sandboxing tool is
    sandboxed. Empty when no tool of the set runs untrusted code. Add it to the step's metrics."""
    counting = [t for t in tools.tools.values() if hasattr(t, "num_unsandboxed_calls")]
    if not counting:
        return {}
    unsandboxed = 0
    for tool in counting:
        unsandboxed += tool.num_unsandboxed_calls - getattr(tool, "_reported_unsandboxed", 0)
        tool._reported_unsandboxed = tool.num_unsandboxed_calls
    return {
        "tool/unsandboxed": float(unsandboxed),
        "tool/sandboxed": float(all(getattr(t, "sandboxed", False) for t in counting)),
    }


__all__ = [
    "BUILTIN_TOOLS",
    "Calculator",
    "Tool",
    "ToolResult",
    "ToolSet",
    "make_tool",
    "sandbox_metrics",
    "validate_arguments",
]
