"""Time intervals: the one definition of "time in flight" (T_comm) and of "time blocked" (ZeRO-3's exposed
communication), both the length of a union, so concurrent or nested intervals count once. Pure."""

from __future__ import annotations


def union_length(intervals) -> float:
    """Length of the union of (start, end) pairs, in the pairs' unit (seconds in dtlab)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return float(total)


def frame_union_length(df) -> float:
    """Length of the union of a DataFrame's [t_start, t_end] rows (concurrent collectives counted once)."""
    return union_length(zip(df["t_start"], df["t_end"]))
