"""Log-slider grid arithmetic shared by the explorer's state and its widgets: the browser's slider snaps its
value to min + k * step, so a range and a value must be chosen so that the value lies on that grid."""

from __future__ import annotations

import numpy as np


def anchored_min(e: float, lo_exp: float, step: float) -> float:
    """The slider minimum at or below `lo_exp` that puts exponent `e` exactly on the slider's step grid.

    The browser's slider (noUiSlider) snaps its value to min + k * step and sends the snapped value back to
    the kernel as soon as it renders: a value off the grid would come back changed (25 MiB as 25.1 MiB, a
    fitted alpha as a slightly different one)."""
    return e - np.ceil((e - lo_exp) / step - 1e-9) * step


def log_range(value: float, lo_exp: float, hi_exp: float, base: float, step: float) -> tuple[float, float]:
    """(min, max) exponents of a log slider: [lo_exp, hi_exp] widened to contain `value`, with the minimum
    moved so that the step grid passes through `value`."""
    e = float(np.log(value) / np.log(base))
    return anchored_min(e, min(lo_exp, np.floor(e)), step), max(hi_exp, np.ceil(e))


def on_log_grid(shown: float, value: float, base: float, step: float) -> bool:
    """True when a log slider showing `shown` shows `value`: within half a step of it (the browser's snapping
    included)."""
    d = abs(np.log(float(shown)) - np.log(float(value))) / np.log(base)
    return bool(d <= step / 2 + 1e-9)
