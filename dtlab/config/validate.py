"""Field validators shared by the config dataclasses: each raises ValueError naming the field and what is allowed.

(Named `validate` to tell them from the course's answer checks, dtlab.course.checks.)"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


def refuse_unknown(what: str, d: dict, cls, also: tuple[str, ...] = ()) -> None:
    """ValueError naming every key of `d` that is neither a field of dataclass `cls` nor one of `also`."""
    names = {f.name for f in dataclasses.fields(cls)} | set(also)
    unknown = sorted(map(str, set(d) - names))
    if unknown:
        raise ValueError(f"unknown {what} field(s): {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")


def finite(name: str, value: Any, unit: str, *, low: float, high: float | None = None) -> None:
    """A real, finite number with low < value (<= high): inf, nan, booleans and strings are refused by name."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value > low
        and (high is None or value <= high)
    )
    if not ok:
        num = lambda x: f"{int(x):,}" if float(x).is_integer() else f"{x:g}"  # noqa: E731
        rng = f"> {num(low)}" + (f" and <= {num(high)}" if high is not None else "")
        raise ValueError(f"{name} must be a finite number {rng}{' ' + unit if unit else ''}, got {value!r}")


def int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
