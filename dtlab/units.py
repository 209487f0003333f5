"""Units, named once: seconds and bytes in the data, MiB for bucket caps, milliseconds (or microseconds for alpha)
and GB/s (10^9 bytes per second) on screen. Every number a person reads goes through one of these helpers."""

from __future__ import annotations

MIB = 2**20
"""Bytes in one MiB (DDP's bucket_cap_mb counts MiB)."""


def fmt_bytes(n) -> str:
    """Human-readable binary size: '512 B', '4 KiB', '25 MiB', '1.5 GiB'."""
    n = float(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_mib(mb) -> str:
    """A MiB value for labels: three significant digits below 100, whole numbers above ('0.25', '24.9', '1024')."""
    mb = float(mb)
    return f"{mb:.0f}" if mb >= 100 else f"{mb:.3g}"


def fmt_ms(seconds, width: int = 0, digits: int = 1) -> str:
    """Seconds shown as milliseconds: fmt_ms(0.0123) -> '12.3 ms'; 'n/a' for None or NaN."""
    if seconds is None or seconds != seconds:
        return f"{'n/a':>{width}}   " if width else "n/a"
    return f"{seconds * 1e3:{width}.{digits}f} ms"


def fmt_us(seconds, digits: int = 1) -> str:
    """Seconds shown as microseconds (latencies, alpha): fmt_us(8.4e-6) -> '8.4 us'."""
    return f"{seconds * 1e6:.{digits}f} us"


def fmt_gbps(bytes_per_second) -> str:
    """Bandwidth in GB/s (10^9 bytes per second), three significant digits; 'inf' when unbounded."""
    if bytes_per_second is None or bytes_per_second == float("inf") or bytes_per_second <= 0:
        return "inf"
    return f"{bytes_per_second / 1e9:.3g} GB/s"


def fmt_count(n) -> str:
    """A whole number with thousands separators: fmt_count(4045448) -> '4,045,448' (numpy integers too)."""
    return f"{int(n):,}"


def fmt_bytes_exact(n) -> str:
    """An exact byte count: fmt_bytes_exact(4045448) -> '4,045,448 B'."""
    return f"{fmt_count(n)} B"


def sig(x: float, digits: int) -> str:
    """`digits` significant digits, never in exponent notation: 0.0123, 45.2, 1,250."""
    text = f"{x:.{digits}g}"
    return f"{x:,.0f}" if "e" in text else text


def fmt_time(seconds, digits: int = 3) -> str:
    """Seconds shown in the unit that reads best: µs below 1 ms, ms below 1 s, else s, `digits` significant
    digits: fmt_time(7.2e-4) -> '720 µs', fmt_time(0.0123) -> '12.3 ms', fmt_time(1.25) -> '1.25 s'; 'n/a'
    for None or NaN."""
    if seconds is None or seconds != seconds:
        return "n/a"
    s = float(seconds)
    for scale, unit, limit in ((1e6, "µs", 1e-3), (1e3, "ms", 1.0)):
        if abs(s) < limit and abs(float(sig(s * scale, digits).replace(",", ""))) < 1000:
            return f"{sig(s * scale, digits)} {unit}"
    return f"{sig(s, digits)} s"


def fmt_ratio(x, digits: int = 3) -> str:
    """A ratio of two like quantities: fmt_ratio(0.25) -> '×0.25'."""
    return "n/a" if x is None or x != x else f"×{sig(float(x), digits)}"


def sig_table(df, digits: int = 3):
    """`df` for the screen with every float column as text of `digits` significant digits (never in exponent
    notation) and an exact zero as '0', so no nonzero value is rounded away to a decimal zero (0.05 as 0.0) and no
    zero claims decimals it does not have; missing values stay missing. Other columns are kept as they are."""
    import pandas as pd

    out = df.copy()
    for col in out.columns:
        if pd.api.types.is_float_dtype(out[col]):
            out[col] = [v if pd.isna(v) else "0" if v == 0 else sig(float(v), digits) for v in out[col]]
    return out
