"""Parse Qwen2.5 / Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedCall:
    """One tool call found in an assistant turn."""

    name: str
    """Tool name ('' when unparsable)."""
    arguments: Any
    """Argument dict, or the raw text of the call when it could not be parsed."""
    error: str | None = None
    """Why the call is malformed; None when it parsed."""


def parse_tool_calls(text: str, start: str = "<tool_call>", end: str = "</tool_call>") -> list[ParsedCall]:
    """Every call in `text`, in order; several calls per turn are allowed.

    A block that is not a JSON object with a string `name` and an object `arguments` (a JSON
    string holding an object is accepted too), or an opening tag with no closing tag, yields a
    call with `error` set instead of raising.
    """
    calls = []
    pattern = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.DOTALL)
    pos = 0
    for match in pattern.finditer(text):
        calls.append(_parse_one(match.group(1)))
        pos = match.end()
    tail = text[pos:]
    if start in tail:
        calls.append(ParsedCall("", tail[tail.index(start) :], f"unclosed {start} (no {end})"))
    return calls


def _parse_one(body: str) -> ParsedCall:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return ParsedCall("", body, f"invalid JSON: {exc}")
    if not isinstance(obj, dict):
        return ParsedCall("", body, "the call is not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall("", body, "the call has no string 'name'")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ParsedCall(name, body, "'arguments' is a string that is not JSON")
    if not isinstance(args, dict):
        return ParsedCall(name, body, "'arguments' is not a JSON object")
    return ParsedCall(name, args)
