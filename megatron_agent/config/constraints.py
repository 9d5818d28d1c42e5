"""The allowed range of a config number, written next to the field in `schema.py`.

A field carries its range in its type: `n: PositiveInt = 4`, or `Annotated[float, Range(gt=0, le=1)]`
for a range of its own; a list's items as `list[PositiveFloat]`. `field_violations(cfg)` checks
every field at load time and returns one message per violation, all of them at once (`load.py`).
Checks between fields (a mini-batch dividing the batch) are in `validate.py`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any


@dataclass(frozen=True)
class Range:
    """Bounds of a number (None: unbounded on that side), and why, when the bound is not obvious."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""

    def contains(self, value: float) -> bool:
        """True when `value` is inside the range (NaN never is)."""
        return (
            value == value
            and (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def violation(self, value: float) -> str | None:
        """'must be >= 1' (and why) when `value` is outside the range; None inside it."""
        if self.contains(value):
            return None
        return f"must be {self.describe()}" + (f" ({self.why})" if self.why else "")

    def describe(self) -> str:
        """The range as text, e.g. '> 0 and <= 1'."""
        parts = [
            f"{op} {bound:g}"
            for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if bound is not None
        ]
        return " and ".join(parts)


PositiveInt = Annotated[int, Range(ge=1)]
"""An int >= 1 (a size, a count that cannot be zero)."""
NonNegativeInt = Annotated[int, Range(ge=0)]
"""An int >= 0 (a count, a step, a seed; 0 often means off)."""
PositiveFloat = Annotated[float, Range(gt=0)]
"""A float > 0 (a timeout, a tolerance, a target)."""
NonNegativeFloat = Annotated[float, Range(ge=0)]
"""A float >= 0 (a coefficient, a rate; 0 often means off)."""
Fraction = Annotated[float, Range(ge=0, le=1)]
"""A float in [0, 1]."""


def range_of(typ: Any) -> Range | None:
    """The `Range` that an annotated type carries (through `X | None` and `list[X]`), or None."""
    origin = typing.get_origin(typ)
    if origin is Annotated:
        return next((m for m in typ.__metadata__ if isinstance(m, Range)), None)
    if origin in (typing.Union, types.UnionType, list):
        found = [r for r in map(range_of, typing.get_args(typ)) if r is not None]
        return found[0] if found else None
    return None


def annotated_fields(cls) -> dict[str, Any]:
    """Field name -> its type with the `Annotated` ranges kept."""
    return typing.get_type_hints(cls, include_extras=True)


def field_violations(obj, prefix: str = "", key_of_field: dict[str, str] | None = None) -> list[str]:
    """One message per field of the dataclass tree `obj` whose value is outside its range."""
    key_of_field = key_of_field or {}
    hints, problems = annotated_fields(type(obj)), []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{key_of_field.get(f.name, f.name)}"
        if dataclasses.is_dataclass(value):
            problems += field_violations(value, f"{key}.", key_of_field)
            continue
        bounds = range_of(hints[f.name])
        if bounds is None or value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            problem = bounds.violation(item)
            if problem:
                problems.append(f"{key}={value!r} {problem}")
                break
    return problems
