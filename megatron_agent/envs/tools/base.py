"""The tool protocol and the runner that turns any tool misbehaviour into data.

A tool has a `name`, a `description`, JSON-schema `parameters` and an async `call(**arguments)`
returning text (or bytes). `ToolSet.run` validates the arguments, runs the call under a
per-call timeout and converts every failure (unknown tool, wrong arguments, an exception, a
hang, invalid UTF-8) into a `ToolResult` with an error message and a status, never an exception.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

_JSON_TYPES = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class Tool:
    """Base class of tools. Subclasses set `name`, `description`, `parameters` and define `call`."""

    name: str = ""
    """Name the model calls the tool by."""
    description: str = ""
    """One-line description shown to the model."""
    parameters: dict = {"type": "object", "properties": {}, "required": []}
    """JSON schema of the arguments (an object)."""
    timeout_s: float | None = None
    """Per-call timeout; None uses the ToolSet's default."""
    limits_own_time: bool = False
    """True when `call` applies `timeout_s` itself (from when the call starts running, after any
    wait for a free slot) and raises TimeoutError; the ToolSet then sets no limit of its own."""

    async def call(self, **arguments: Any) -> str | bytes:
        """Run the tool; raise to report an error (the message becomes the tool response)."""
        raise NotImplementedError

    def schema(self) -> dict:
        """OpenAI-style function schema, as chat templates expect in `tools`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def validate_arguments(arguments: dict, schema: dict) -> str | None:
    """A message naming the first problem of `arguments` against a flat object `schema`, or None."""
    props = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in arguments:
            return f"missing required argument '{key}'"
    for key, value in arguments.items():
        if key not in props:
            return f"unknown argument '{key}' (expected: {', '.join(sorted(props)) or 'none'})"
        types = _JSON_TYPES.get(props[key].get("type", ""), None)
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            return f"argument '{key}' should be a {props[key]['type']}, got {type(value).__name__}"
    return None


@dataclass
class ToolResult:
    """What a tool call produced, ready to be tokenized as the tool response."""

    text: str
    """Response text (an error message when status is not ok)."""
    status: str
    """ok, unknown_tool, bad_arguments, error, timeout, invalid_utf8 (the loop may add truncated)."""
    seconds: float = 0.0
    """Wall time of the call."""


def _to_text(out: Any) -> tuple[str, bool]:
    """Tool output as valid text, and whether it had to be repaired (invalid UTF-8)."""
    if isinstance(out, (bytes, bytearray)):
        try:
            return bytes(out).decode("utf-8"), False
        except UnicodeDecodeError:
            return bytes(out).decode("utf-8", errors="replace"), True
    text = out if isinstance(out, str) else str(out)
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:  # lone surrogates
        return text.encode("utf-8", errors="replace").decode("utf-8"), True


class ToolSet:
    """The tools of a run, by name, with a default per-call timeout."""

    def __init__(self, tools: list[Tool], timeout_s: float = 10.0, max_threads: int = 16):
        """`tools` must have distinct names; synchronous tools share `max_threads` threads."""
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if not tool.name:
                raise ValueError(f"tool {tool!r} has no name")
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.timeout_s = timeout_s
        # Our own pool, not asyncio's default one: `asyncio.run` waits for the default pool's
        # threads at exit, so a synchronous tool hanging past its timeout would hang the run.
        # (Such a thread still lives until the tool returns; untrusted code belongs in a
        # subprocess tool such as `python`, which is killed at its timeout.)
        self._executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="tool")

    def schemas(self, names: list[str] | None = None) -> list[dict]:
        """Schemas of the tools named (all when None), for the chat template."""
        chosen = self.tools if names is None else {n: self.tools[n] for n in names if n in self.tools}
        return [t.schema() for t in chosen.values()]

    async def run(self, name: str, arguments: Any, allowed: list[str] | None = None) -> ToolResult:
        """Call tool `name`; every failure comes back as a ToolResult with an error status."""
        start = time.monotonic()
        if name not in self.tools or (allowed is not None and name not in allowed):
            names = sorted(self.tools if allowed is None else set(allowed) & set(self.tools))
            return ToolResult(
                f"Error: unknown tool '{name}'. Available tools: {', '.join(names)}.", "unknown_tool"
            )
        tool = self.tools[name]
        if not isinstance(arguments, dict):
            return ToolResult(f"Error: arguments of '{name}' must be a JSON object.", "bad_arguments")
        problem = validate_arguments(arguments, tool.parameters)
        if problem:
            return ToolResult(f"Error: {name}: {problem}.", "bad_arguments")
        timeout = tool.timeout_s if tool.timeout_s is not None else self.timeout_s
        try:
            if inspect.iscoroutinefunction(tool.call):
                # In this task, not a new one (as wait_for would): a SystemExit raised by the
                # tool (argparse on bad input, sys.exit) then reaches the handler below instead
                # of escaping the event loop and ending every rollout of the engine.
                async with asyncio.timeout(None if tool.limits_own_time else timeout):
                    out = await tool.call(**arguments)
            else:  # a synchronous tool runs in a thread so that it cannot block the event loop
                run = functools.partial(tool.call, **arguments)
                out = await asyncio.wait_for(
                    asyncio.get_running_loop().run_in_executor(self._executor, run), timeout
                )
        except TimeoutError:
            return ToolResult(
                f"Error: {name} timed out after {timeout:g} s.", "timeout", time.monotonic() - start
            )
        except asyncio.CancelledError:
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any tool failure is data
            msg = str(exc) or type(exc).__name__
            if isinstance(exc, SystemExit):
                msg = f"exited with status {exc.code}"
            return ToolResult(f"Error: {name} failed: {msg[:500]}", "error", time.monotonic() - start)
        text, repaired = _to_text(out)
        seconds = time.monotonic() - start
        if repaired:
            return ToolResult(
                f"Error: {name} returned invalid UTF-8 (replaced): {text}", "invalid_utf8", seconds
            )
        return ToolResult(text, "ok", seconds)
