"""`calculator`: safe arithmetic over an AST whitelist (no eval, no names, no calls)."""

from __future__ import annotations

import ast
import math
import operator

from megatron_agent.envs.tools.base import Tool

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100


def evaluate(expression: str) -> int | float:
    """Value of an arithmetic `expression` (+ - * / // % **, parentheses, numbers).

    Raises ValueError for anything else (names, calls, attributes), for exponents above
    MAX_EXPONENT or results above MAX_MAGNITUDE, and ZeroDivisionError for division by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"unsupported element {type(node).__name__} (only numbers and + - * / // % **)")


def format_number(value: int | float) -> str:
    """Integers without a decimal point, floats to 10 significant digits."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)


class Calculator(Tool):
    """Evaluate an arithmetic expression."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
        "required": ["expression"],
    }

    async def call(self, expression: str) -> str:
        """The expression's value as text."""
        return format_number(evaluate(expression))
