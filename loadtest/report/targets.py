"""The issue's targets, and the pass/short verdict of a figure against one.

A verdict is ``pass`` or ``short``; a figure that could not be measured
(NaN) is ``short`` too. A target defined at a size (10,000 connections,
5,000 observers) still gets a verdict at another size, with a note saying
the run was not at the target's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    scenario: str
    figure: str
    unit: str
    op: str  # "<=" or ">="
    limit: float
    at_size: tuple[str, int] | None = None


def check(target: Target, value: float, size: int, note: str = "") -> dict[str, Any]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        passed = False
    elif target.op == "<=":
        passed = value <= target.limit
    else:
        passed = value >= target.limit
    notes = [note] if note else []
    if target.at_size is not None and size != target.at_size[1]:
        notes.append(f"run at {size} {target.at_size[0]}; the target is set at {target.at_size[1]}")
    return {
        "scenario": target.scenario,
        "figure": target.figure,
        "unit": target.unit,
        "op": target.op,
        "limit": target.limit,
        "value": value,
        "verdict": "pass" if passed else "short",
        "note": "; ".join(notes),
    }


def format_value(value: Any, unit: str) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        text = f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    else:
        text = str(value)
    return f"{text} {unit}".strip() if unit and unit != "x" else (text + ("x" if unit else ""))
