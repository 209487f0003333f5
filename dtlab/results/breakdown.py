"""The breakdown `Run.summary()` prints: T_step, T_comp, T_comm, exposed communication and overlap, each with its
spread, and how busy the machine was (pure; the definitions are dtlab.results.run's).

Everything is computed on whole columns (one groupby per frame, no loop over steps), so a 3,000-step run reads
as fast as a short one. Each figure comes with a 90% bootstrap interval (dtlab.results.spread): over the measured
steps for T_step and T_comm, over the pairs of a no-op-hook step and the training step it followed for exposed
communication (dtlab.config.baseline), both for T_comp = T_step - exposed and for the overlap. An exposed time
whose interval is not above 0 is not shown as a figure: its row says, in words, how large the noise is.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd

from dtlab.config.placement import TIMING_METHODS
from dtlab.results.busy import machine_state
from dtlab.results.spread import (
    SEED,
    block_for,
    exposed_words,
    hull,
    interval,
    median_bounds,
    medians,
    overlap_words,
    resample_index,
    resamples_for,
    resolved,
)
from dtlab.units import fmt_ms

PER_STEP_COLUMNS = ["step", "t_step", "t_comm", "t_comp_est"]
SUMMARY_COLUMNS = ["quantity", "value", "unit", "how", "lo", "hi"]
#: a collective in flight, whatever recorded it (a DDP bucket, a ZeRO-3 or split strategy's collective)
INTERVAL_COLUMNS = ["rank", "step", "t_start", "t_end"]


def comm_intervals(*frames: pd.DataFrame) -> pd.DataFrame:
    """The INTERVAL_COLUMNS of every row of `frames` (buckets, collectives), in one frame (empty: the columns)."""
    parts = [f[INTERVAL_COLUMNS] for f in frames if not f.empty]
    if not parts:
        return pd.DataFrame(columns=INTERVAL_COLUMNS)
    # one frame (a DDP run's buckets): its own columns, numbered from 0 as a concatenation numbers them
    return parts[0].reset_index(drop=True) if len(parts) == 1 else pd.concat(parts, ignore_index=True)


def union_lengths(intervals: pd.DataFrame) -> pd.Series:
    """Length of the union of the [t_start, t_end] rows of each (rank, step), concurrent intervals counted once
    (dtlab.intervals.union_length, on whole columns): a Series indexed by (rank, step)."""
    rank, step, total = union_arrays(intervals)
    return pd.Series(total, index=pd.MultiIndex.from_arrays([rank, step], names=["rank", "step"]))


def union_arrays(intervals: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`union_lengths` as arrays (rank, step, length), one entry per (rank, step) in that order. Rows already in
    (rank, step, t_start) order, as load_run keeps a DDP run's buckets, are read as they are; others are sorted."""
    if intervals.empty:
        return np.array([]), np.array([]), np.array([], dtype=float)
    rank, step = intervals["rank"].to_numpy(), intervals["step"].to_numpy()
    start, end = intervals["t_start"].to_numpy(dtype=float), intervals["t_end"].to_numpy(dtype=float)
    if not in_order(rank, step, start):
        order = np.lexsort((end, start, step, rank))
        rank, step, start, end = rank[order], step[order], start[order], end[order]
    first = np.ones(len(rank), dtype=bool)
    first[1:] = (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])
    group = np.cumsum(first) - 1
    # one running maximum over every group at once: each group lifted above the last by more than any span
    lift = group * (np.nanmax(end) - np.nanmin(start) + 1.0)
    reach = np.maximum.accumulate(end + lift)  # the furthest end so far in the (rank, step)
    new = first.copy()
    new[1:] |= start[1:] + lift[1:] > reach[:-1]  # a gap starts a new segment
    heads = np.flatnonzero(new)
    length = np.maximum.reduceat(end, heads) - start[heads]
    g0 = np.flatnonzero(first)
    total = np.add.reduceat(length, np.searchsorted(heads, g0))
    return rank[g0], step[g0], total


def in_order(rank: np.ndarray, step: np.ndarray, start: np.ndarray | None = None) -> bool:
    """True when the rows are in (rank, step) order (and, with `start`, by start within each (rank, step)), with
    numeric keys and no NaN among them: what a lexsort would leave as it is, up to ties (a union's length and a
    group's maximum do not depend on the order of ties)."""
    if len(rank) < 2:
        return True
    if rank.dtype.kind not in "iuf" or step.dtype.kind not in "iuf":
        return False
    dr, ds = np.diff(rank), np.diff(step)
    ok = (dr > 0) | ((dr == 0) & (ds >= 0))
    if start is not None:
        ok &= (dr != 0) | (ds != 0) | (np.diff(start) >= 0)
    return bool(ok.all())


def group_max(frame: pd.DataFrame, column: str, rank, step) -> np.ndarray:
    """The largest `column` value (NaN skipped) of `frame`'s rows of each (rank[i], step[i]) pair; NaN where the
    frame has no row of that pair. `frame.groupby(["rank", "step"])[column].max()` looked up pair by pair, read
    in one pass over a frame in (rank, step) order (load_run's buckets)."""
    rank, step = np.asarray(rank), np.asarray(step)
    r, s = frame["rank"].to_numpy(), frame["step"].to_numpy()
    ints = all(a.dtype.kind in "iu" for a in (r, s, rank, step))
    if not ints or not in_order(r, s):
        ready = frame.groupby(["rank", "step"])[column].max()
        return ready.reindex(pd.MultiIndex.from_arrays([rank, step])).to_numpy(dtype=float)
    first = np.ones(len(r), dtype=bool)
    first[1:] = (r[1:] != r[:-1]) | (s[1:] != s[:-1])
    heads = np.flatnonzero(first)
    top = np.fmax.reduceat(frame[column].to_numpy(dtype=float), heads)
    lo = min(int(s.min()), int(step.min()) if step.size else 0)
    span = max(int(s.max()), int(step.max()) if step.size else 0) - lo + 1
    have, want = r[heads].astype(np.int64) * span + (s[heads] - lo), rank.astype(np.int64) * span + (step - lo)
    pos = np.minimum(np.searchsorted(have, want), len(have) - 1)
    return np.where(have[pos] == want, top[pos], np.nan)


def per_step(run) -> pd.DataFrame:
    """One row per measured step (see `Run.per_step`): the slowest rank's t_step, the longest in-flight union
    over ranks (t_comm), the estimated compute on the slowest rank (t_comp_est) and, for ZeRO-3 runs that measured
    it, t_blocked, with t_comp_est = t_step - t_blocked."""
    st = run.measured_steps()
    st = st[st["t_step"].notna()]
    if st.empty:
        return pd.DataFrame(columns=PER_STEP_COLUMNS)
    slow = st.loc[st.groupby("step")["t_step"].idxmax()].sort_values("step")
    comm = run.comm_intervals()
    if comm.empty:
        t_comm = np.zeros(len(slow))
    else:
        _, step, total = union_arrays(comm)
        lengths = pd.Series(total).groupby(step).max()
        t_comm = slow["step"].map(lengths).fillna(0.0).to_numpy(dtype=float)
    compute_end = (slow["t_fwd"] + slow["t_bwd"]).to_numpy(dtype=float)
    if not run.buckets.empty:
        found = group_max(run.buckets, "t_ready", slow["rank"].to_numpy(), slow["step"].to_numpy())
        compute_end = np.where(np.isnan(found), compute_end, found)
    out = pd.DataFrame(
        {
            "step": slow["step"].to_numpy(),
            "t_step": slow["t_step"].to_numpy(dtype=float),
            "t_comm": t_comm,
            "t_comp_est": compute_end + slow["t_opt"].to_numpy(dtype=float),
        }
    )
    if run.measures_blocked:
        out["t_blocked"] = slow["t_blocked"].to_numpy(dtype=float)
        out["t_comp_est"] = out["t_step"] - out["t_blocked"]
    return out


def pairs(run, ps: pd.DataFrame) -> pd.DataFrame | None:
    """One row per baseline step recorded with the training step it followed (`paired_step`): baseline, step,
    t_comp (slowest rank of the baseline step), t_step and t_comm (of the paired step), diff = t_step - t_comp.
    A baseline step whose paired step is not a measured step of the run is left out. None for a run whose
    baseline steps carry no pairing (recorded before it, or no baseline steps)."""
    b = run.baseline_steps
    if b.empty or "paired_step" not in b.columns or b["paired_step"].isna().all():
        return None
    g = b.groupby("step").agg(t_comp=("t_step", "max"), paired=("paired_step", "first")).reset_index()
    g = g.rename(columns={"step": "baseline"}).dropna(subset=["paired"])
    g["paired"] = g["paired"].astype(int)
    out = g.merge(ps[["step", "t_step", "t_comm"]], left_on="paired", right_on="step", how="inner")
    out = out.sort_values("baseline").reset_index(drop=True)
    out["diff"] = out["t_step"] - out["t_comp"]
    return out[["baseline", "step", "t_comp", "t_step", "t_comm", "diff"]]


def _median(v) -> float:
    v = np.asarray(v, dtype=float)
    return float(np.median(v)) if v.size else math.nan


def timing_method(run) -> str:
    """How the run's figures were taken: a key of dtlab.config.placement.TIMING_METHODS, as the ranks recorded it
    (`resolved.timing_method`). A run recorded before that: 'tp', 'pp' and 'fsdp2' said "host wall clocks" (their
    marks were time.perf_counter on every device), the asynchronous server synchronised the device at each mark,
    the others took CUDA events on CUDA."""
    r = run.resolved
    rec = r.get("timing_method")
    if isinstance(rec, dict) and rec.get("method") in TIMING_METHODS:
        return rec["method"]
    if isinstance(r.get("collective_timing"), str) and "wall clock" in r["collective_timing"]:
        return "wall_clock"
    if r.get("device_type") != "cuda":
        return "wall_clock"
    return "wall_clock_synced" if run.spec.asynchronous else "cuda_events"


def figures(run) -> dict:
    """Everything `summary` shows, before the noise rule: ps (per_step), pairs (or None), machine (dtlab.results.busy),
    for each of t_step, t_comm, t_comp and exposed its median, `<name>_iv` (its 90% interval) and `<name>_rep`
    (bootstrap replicates of it), overlap_iv, `how_*` (where each comes from), noise_rule (exposed is a difference,
    shown only above the noise), assumed (exposed is T_comm, not measured), n_diff and per (how many values
    exposed's median is over, and what they are)."""
    ps = per_step(run)
    n = len(ps)
    said = machine_state(run, ps["t_step"])
    busy = bool(said["busy"])
    rng = np.random.default_rng(SEED)
    b = resamples_for(n)  # one count for every figure: T_comp and the overlap combine their replicates
    idx = resample_index(n, block_for(n, busy), rng, b)
    ts, tc = ps["t_step"].to_numpy(dtype=float), ps["t_comm"].to_numpy(dtype=float)
    ts_rep, tc_rep = medians(ts, idx), medians(tc, idx)
    t_step, t_comm = _median(ts), _median(tc)
    ts_iv, tc_iv = hull(interval(ts_rep), median_bounds(ts)), hull(interval(tc_rep), median_bounds(tc))
    c = SimpleNamespace(
        ps=ps,
        busy=busy,
        rng=rng,
        b=b,
        idx=idx,
        ts=ts,
        tc=tc,
        ts_rep=ts_rep,
        tc_rep=tc_rep,
        t_step=t_step,
        t_comm=t_comm,
        ts_iv=ts_iv,
        tc_iv=tc_iv,
    )
    pr = pairs(run, ps)
    x = {
        "how_exposed": "T_step - T_comp",
        "how_overlap": "1 - exposed / T_comm",
        "per": "steps",
        "n_diff": n,
        "noise_rule": True,  # exposed is a difference of two measurements: shown only when it stands out of the noise
        "assumed": False,
        **_exposed(run, c, pr),
    }
    d_rep, e_iv, t_comp, exposed = x["d_rep"], x["e_iv"], x["t_comp"], x["exposed"]
    with np.errstate(divide="ignore", invalid="ignore"):
        ov_iv = hull(
            interval(1.0 - np.asarray(d_rep) / np.asarray(tc_rep)),
            (1.0 - e_iv[1] / t_comm, 1.0 - e_iv[0] / t_comm) if t_comm > 0 else (math.nan, math.nan),
        )
    return {
        "ps": ps,
        "n": n,
        "pairs": pr,
        "machine": said,
        "t_step": t_step,
        "t_step_rep": ts_rep,
        "t_comm": t_comm,
        "t_comm_rep": tc_rep,
        "t_comp": t_comp,
        "t_comp_rep": x["comp_rep"],
        "exposed": exposed,
        "exposed_rep": d_rep,
        "t_step_iv": _around(t_step, ts_iv),
        "t_comm_iv": _around(t_comm, tc_iv),
        "t_comp_iv": _around(t_comp, x["c_iv"]),
        "exposed_iv": _around(exposed, e_iv),
        "overlap_iv": ov_iv,
        **{k: x[k] for k in ("how_comp", "how_exposed", "how_overlap", "noise_rule", "assumed", "n_diff", "per")},
    }


def _exposed(run, c, pr) -> dict:
    """T_comp and exposed communication (t_comp, comp_rep, c_iv, exposed, d_rep, e_iv, how_comp, and what differs
    from `figures`' defaults), from the best measurement the run has: paired no-op hook steps, unpaired ones, the
    time blocked on collectives, or (none of those) an estimate."""
    if pr is not None and not pr.empty:
        return _from_pairs(c, pr)
    if not run.baseline_steps.empty:
        base = run.baseline_steps.groupby("step")["t_step"].max().to_numpy(dtype=float)
        comp_rep = medians(base, resample_index(len(base), block_for(len(base), c.busy), c.rng, c.b))
        t_comp = _median(base)
        c_iv = hull(interval(comp_rep), median_bounds(base))
        return {
            "t_comp": t_comp,
            "comp_rep": comp_rep,
            "c_iv": c_iv,
            "exposed": c.t_step - t_comp,
            "d_rep": c.ts_rep - comp_rep,
            "e_iv": hull(interval(c.ts_rep - comp_rep), (c.ts_iv[0] - c_iv[1], c.ts_iv[1] - c_iv[0])),
            "how_comp": f"measured: median of {len(base)} no-op comm hook steps (run after the training steps, "
            "unpaired: recorded before baseline steps were interleaved)",
            "n_diff": len(base),
        }
    if run.measures_blocked and "t_blocked" in c.ps.columns:
        return _from_blocked(run, c)
    if not run.collectives.empty and run.buckets.empty:
        # A ZeRO-3 run recorded before blocked time was measured.
        comp = c.ts - c.tc
        return {
            "t_comp": _median(comp),
            "comp_rep": medians(comp, c.idx),
            "c_iv": hull(interval(medians(comp, c.idx)), median_bounds(comp)),
            "how_comp": "estimated: T_step - T_comm (recorded without blocked-time measurement; assumes no overlap)"
            if run.spec.blocked_time
            else "estimated: T_step - T_comm (blocking collectives)",
            "how_exposed": "assumed = T_comm (no baseline to measure it against)",
            "how_overlap": "not measured",
            **{"exposed": c.t_comm, "d_rep": c.tc_rep, "e_iv": c.tc_iv, "noise_rule": False, "assumed": True},
        }
    te = c.ps["t_comp_est"].to_numpy(dtype=float)
    t_comp, comp_rep = _median(te), medians(te, c.idx)
    return {
        "t_comp": t_comp,
        "comp_rep": comp_rep,
        "c_iv": hull(interval(comp_rep), median_bounds(te)),
        "exposed": c.t_step - t_comp,
        "d_rep": c.ts_rep - comp_rep,
        "e_iv": hull(interval(c.ts_rep - comp_rep), median_bounds(c.ts - te)),
        "how_comp": "estimated: fwd + bwd until the last bucket was ready + opt (no baseline run)",
    }


def _from_pairs(c, pr) -> dict:
    """Exposed = the median over training steps of (its time - its paired no-op hook step's)."""
    m = len(pr)
    d_rep = medians(pr["diff"], resample_index(m, block_for(m, c.busy), c.rng, c.b))
    exposed = _median(pr["diff"])
    e_iv = hull(interval(d_rep), median_bounds(pr["diff"]))
    return {
        "exposed": exposed,
        "d_rep": d_rep,
        "e_iv": e_iv,
        "t_comp": c.t_step - exposed,
        "comp_rep": c.ts_rep - d_rep,
        "c_iv": hull(interval(c.ts_rep - d_rep), (c.t_step - e_iv[1], c.t_step - e_iv[0])),
        "how_comp": f"measured: T_step - exposed, from {m} no-op comm hook steps each paired with the training "
        f"step just before it (alone: median {fmt_ms(_median(pr['t_comp']))})",
        "how_exposed": f"median over {m} pairs of T_step - T_comp (a training step, then a no-op comm hook step)",
        "per": "pairs",
        "n_diff": m,
    }


def _from_blocked(run, c) -> dict:
    """ZeRO-3 has no no-op baseline; its waits on collectives are timed instead
    (dtlab.rank.strategies.zero3.blocked)."""
    tb = c.ps["t_blocked"].to_numpy(dtype=float)
    d_rep, comp_rep = medians(tb, c.idx), medians(c.ts - tb, c.idx)
    where = "compute stream" if timing_method(run) == "cuda_events" else "training thread"
    return {
        "exposed": _median(tb),
        "d_rep": d_rep,
        "e_iv": hull(interval(d_rep), median_bounds(tb)),
        "t_comp": _median(c.ts - tb),
        "comp_rep": comp_rep,
        "c_iv": hull(interval(comp_rep), median_bounds(c.ts - tb)),
        "how_comp": "measured: T_step - time blocked on collectives (slowest rank, per step)",
        "how_exposed": f"measured: time the slowest rank's {where} was blocked waiting for collectives "
        "(timed waits + blocking calls)",
        "how_overlap": "1 - exposed / T_comm (exposed measured, T_comm = in-flight union)",
        "noise_rule": False,  # measured directly, never negative: a 0 is a measured 0
    }


def _around(value: float, iv: tuple) -> tuple:
    """The interval, widened to hold the figure itself (a percentile interval need not)."""
    return hull(iv, (value, value)) if value == value else iv


def summary(run) -> pd.DataFrame:
    """The headline figures with their 90% intervals (columns quantity, value, unit, how, lo, hi) and a `machine`
    row (value: other processes' CPU in cores' worth; how: the machine's state). See the module docstring."""
    f = figures(run)
    exposed, t_comm = f["exposed"], f["t_comm"]
    e_lo, e_hi = f["exposed_iv"]
    clock = TIMING_METHODS[timing_method(run)]  # the words of the method the ranks recorded
    rows = [
        (
            "T_step",
            f["t_step"],
            "s",
            f"median over {f['n']} steps of the slowest rank's step time ({clock})",
            *f["t_step_iv"],
        ),
        ("T_comp", f["t_comp"], "s", f["how_comp"], *f["t_comp_iv"]),
        (
            "T_comm",
            t_comm,
            "s",
            "median of the time collectives were in flight per step"
            + (" (union of intervals on the rank where longest)" if run.spec.records == "collectives" else ""),
            *f["t_comm_iv"],
        ),
    ]
    if f["noise_rule"] and not resolved(e_lo):
        rows.append(
            ("exposed", math.nan, "s", exposed_words(exposed, e_lo, e_hi, f["n_diff"], f["per"]), math.nan, math.nan)
        )
        rows.append(("overlap", math.nan, "fraction", overlap_words(e_hi, t_comm), math.nan, math.nan))
    else:
        rows.append(("exposed", exposed, "s", f["how_exposed"], e_lo, e_hi))
        rows.append(_overlap(exposed, t_comm, f["overlap_iv"], f["how_overlap"], f["assumed"]))
    other = f["machine"].get("other_cores")
    rows.append(
        ("machine", other if other is not None else math.nan, "cores", f["machine"]["line"], math.nan, math.nan)
    )
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def _overlap(exposed: float, t_comm: float, iv: tuple, how: str, assumed: bool) -> tuple:
    if assumed or not t_comm > 0:
        return ("overlap", math.nan, "fraction", how, math.nan, math.nan)
    ov = 1.0 - exposed / t_comm
    if ov < 0.0 and fmt_ms(exposed) == fmt_ms(t_comm):  # longer only past the digits shown: none hidden, said once
        return (
            "overlap",
            0.0,
            "fraction",
            f"none: exposed is the whole time collectives were in flight ({fmt_ms(t_comm)}), to the digits shown",
            0.0,
            0.0,
        )
    if not 0.0 <= ov <= 1.0:  # exposed longer than the time in flight: not physical, so not a figure
        return (
            "overlap",
            math.nan,
            "fraction",
            f"not measurable here: exposed ({fmt_ms(exposed)}) is longer than "
            f"the time collectives were in flight ({fmt_ms(t_comm)}), which only noise explains",
            math.nan,
            math.nan,
        )
    lo, hi = iv
    return (
        "overlap",
        ov,
        "fraction",
        how,
        min(max(lo, 0.0), ov) if lo == lo else ov,
        max(min(hi, 1.0), ov) if hi == hi else ov,
    )


def summary_lines(s: pd.DataFrame) -> list[str]:
    """The summary as the breakdown's aligned lines: each figure in ms (or a fraction) with its 90% interval and how
    it was obtained; a figure inside the noise as the word "noise" and the sentence that says why; the machine's
    state last."""
    lines = [f"  {'':<8}{'median':>10}     {'[90% interval]':<20} how"]
    for r in s.itertuples():
        if r.quantity == "machine":
            lines.append(f"  {r.how}")
            continue
        ms = r.unit == "s"
        if r.value != r.value:  # NaN: inside the noise, or not measured
            val = f"{'noise' if 'noise' in r.how else 'n/a':>10}   "
        else:
            val = fmt_ms(r.value, width=10) if ms else f"{r.value:10.2f}   "
        lo, hi = getattr(r, "lo", math.nan), getattr(r, "hi", math.nan)
        iv = "" if lo != lo or hi != hi else (f"[{lo * 1e3:.1f}, {hi * 1e3:.1f}]" if ms else f"[{lo:.2f}, {hi:.2f}]")
        lines.append(f"  {r.quantity:<8}{val}  {iv:<20} {r.how}")
    return lines
