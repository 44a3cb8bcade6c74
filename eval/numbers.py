"""How reports write numbers: JSON has no NaN, so an undefined rate is null; a table shows it as —."""

from __future__ import annotations

import math


def json_number(x: float | None) -> float | None:
    """JSON has no NaN: undefined rates (nothing proposed) become null."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def json_ratio(a: float, b: float) -> float | None:
    """a / b, or null when either is undefined or b is 0."""
    return json_number(a / b) if b and not math.isnan(a) and not math.isnan(b) else None


def cell(x: float | None, spec: str) -> str:
    """A table cell: ``x`` formatted with ``spec``, or — when it is undefined."""
    return "—" if x is None else format(x, spec)
