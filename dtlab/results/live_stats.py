"""The numbers a live monitor shows, from the rows a `LiveRun` has read so far (dtlab.results.live). Pure: no torch,
no widgets, no plots. Seconds and bytes in the frames; the text line shows ms, % and GB/s.

The definitions are the run's own (README, dtlab.results.run), applied to what has been recorded so far, and only
to *complete* steps (every rank recorded the step: a step reduced over the ranks that reported it so far would
read too fast):

- T_step per step: the slowest rank's t_step. loss: the mean of the ranks' losses (each rank's own batch).
- T_comm per step: the union of the step's bucket (or collective) intervals, on the rank where it is longest;
  the communication share is T_comm / T_step.
- Exposed communication: T_step - the no-op comm hook step paired with it (`baseline_steps`), only for the pairs
  recorded so far; a run without a baseline has none, and says so.
- Per rank: its t_step, and its own time = t_step - the time it waited for a peer (the clock-free wait of
  dtlab.results.stragglers, from the buckets). A synchronous step ends at the same moment on every rank, so every
  rank's t_step is about the slowest one's: the straggler shows in its own time, not in its t_step.
- The straggler: the rank whose median own time is the slowest, named only when it stands out: ahead of the next
  rank by more than the spread (the median over the ranks of each rank's interquartile range).
- Bus bandwidth per bucket or collective: busbw = nbytes / t x 2(p-1)/p for all-reduce, x (p-1)/p for
  reduce-scatter and all-gather (nccl-tests; dtlab.model.costmodel.busbw), t = t_end - t_start; a compressed
  bucket counts the bytes it sent (`wire_bytes`). Against a calibrated profile, the bus bandwidth its fitted beta
  gives (dtlab.results.recorded.bus_bandwidth); without one it is labelled "no calibration".
"""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd

from dtlab.model import costmodel
from dtlab.results.breakdown import comm_intervals, union_lengths
from dtlab.results.live import KEEP, append_rows
from dtlab.results.recorded import bus_bandwidth
from dtlab.results.stragglers import rank_waits
from dtlab.units import fmt_gbps, fmt_ms

BUS_OPS = ("all_reduce", "reduce_scatter", "all_gather", "ps")  # ops with a bus bandwidth (costmodel.busbw)
STEP_TABLE_COLUMNS = ["step", "t_step", "loss", "t_comm", "comm_share", "compute_busy"]


def complete_steps(steps: pd.DataFrame, nproc: int | None) -> pd.DataFrame:
    """The rows of `steps` (rank, step, ...) whose step every one of `nproc` ranks has recorded (all the rows when
    nproc is None: the world size is unknown)."""
    if steps.empty or not nproc:
        return steps
    count = steps.groupby("step")["rank"].transform("nunique")
    return steps[count >= nproc]


def step_table(steps: pd.DataFrame, comm: pd.DataFrame, nproc: int | None) -> pd.DataFrame:
    """One row per complete step: t_step (s, slowest rank), loss (mean over ranks), t_comm (s, the union of the
    step's communication intervals on the rank where it is longest; NaN where none is recorded), comm_share
    (t_comm / t_step) and compute_busy (the mean over ranks of a recorded compute-stream busy fraction; NaN
    where the events carry none)."""
    st = complete_steps(steps, nproc)
    if st.empty:
        return pd.DataFrame(columns=STEP_TABLE_COLUMNS)
    g = st.groupby("step")
    out = pd.DataFrame({"t_step": g["t_step"].max(), "loss": g["loss"].mean()})
    busy = pd.to_numeric(st["compute_busy"], errors="coerce") if "compute_busy" in st.columns else None
    out["compute_busy"] = busy.groupby(st["step"]).mean() if busy is not None else np.nan
    iv = comm.dropna(subset=["t_start", "t_end"]) if not comm.empty else comm
    if iv.empty:
        out["t_comm"] = np.nan
    else:
        out["t_comm"] = union_lengths(iv.astype({"step": int})).groupby(level="step").max().reindex(out.index)
    out["comm_share"] = out["t_comm"] / out["t_step"]
    return out.reset_index()[STEP_TABLE_COLUMNS]


def exposed_pairs(baseline: pd.DataFrame, table: pd.DataFrame, nproc: int | None) -> pd.DataFrame:
    """One row per no-op comm hook step recorded by every rank and paired with a complete training step: step
    (the training step), t_comp (s, the baseline's slowest rank), exposed (s, t_step - t_comp)."""
    cols = ["step", "t_comp", "exposed"]
    b = complete_steps(baseline, nproc)
    if b.empty or table.empty or b["paired_step"].isna().all():
        return pd.DataFrame(columns=cols)
    b = b.dropna(subset=["paired_step"])
    g = b.groupby("step").agg(t_comp=("t_step", "max"), paired=("paired_step", "first")).reset_index(drop=True)
    g["step"] = g["paired"].astype(int)
    out = g.merge(table[["step", "t_step"]], on="step", how="inner")
    out["exposed"] = out["t_step"] - out["t_comp"]
    return out[cols].sort_values("step").reset_index(drop=True)


def rank_times(steps: pd.DataFrame, buckets: pd.DataFrame, nproc: int | None) -> pd.DataFrame:
    """One row per (rank, complete step): t_step (s), wait_s (s, waiting for a peer; 0 without buckets) and own_s
    (s, t_step - wait_s)."""
    st = complete_steps(steps, nproc)
    cols = ["rank", "step", "t_step", "wait_s", "own_s"]
    if st.empty:
        return pd.DataFrame(columns=cols)
    out = st[["rank", "step", "t_step"]].copy()
    b = buckets[buckets["step"].isin(out["step"])] if not buckets.empty else buckets
    waits = rank_waits(b) if not b.empty else pd.DataFrame(columns=["rank", "step", "wait_s"])
    out = out.merge(waits[["rank", "step", "wait_s"]], on=["rank", "step"], how="left")
    out["wait_s"] = out["wait_s"].fillna(0.0).astype(float)
    out["own_s"] = out["t_step"] - out["wait_s"]
    return out[cols].sort_values(["step", "rank"]).reset_index(drop=True)


def straggler(times: pd.DataFrame, column: str = "own_s") -> dict | None:
    """The rank whose median `column` is the slowest, if it stands out: {rank, median_s, next_rank, next_s, gap_s,
    spread_s} where gap_s = its median - the next rank's and spread_s = the median over the ranks of each rank's
    interquartile range of `column`; None with fewer than 2 ranks, fewer than 3 steps on a rank, or a gap not above
    the spread."""
    if times.empty or times["rank"].nunique() < 2 or times.groupby("rank").size().min() < 3:
        return None
    g = times.groupby("rank")[column]
    med = g.median().sort_values(ascending=False)
    spread = float((g.quantile(0.75) - g.quantile(0.25)).median())
    gap = float(med.iloc[0] - med.iloc[1])
    if gap <= spread:
        return None
    return {
        "rank": int(med.index[0]),
        "median_s": float(med.iloc[0]),
        "next_rank": int(med.index[1]),
        "next_s": float(med.iloc[1]),
        "gap_s": gap,
        "spread_s": spread,
    }


def busbw_rows(comm: pd.DataFrame, nproc: int | None, op: str | None = None) -> pd.DataFrame:
    """`comm` (buckets, or collectives with an `op`) with t (s, t_end - t_start), bytes (wire_bytes where recorded,
    else nbytes) and busbw (bytes/s: nccl-tests' bus bandwidth, `op` for every row or each row's own op). Rows with
    no duration, no bytes or an op without a bus bandwidth (a parameter server's push and pull) are left out."""
    cols = [c for c in comm.columns if c not in ("op", "t", "bytes", "busbw")] + ["op", "t", "bytes", "busbw"]
    if comm.empty or not nproc or nproc < 2:
        return pd.DataFrame(columns=cols)
    c = comm.copy()
    if op is not None:
        c["op"] = op
    c["t"] = c["t_end"].astype(float) - c["t_start"].astype(float)
    wire = pd.to_numeric(c["wire_bytes"], errors="coerce") if "wire_bytes" in c.columns else np.nan
    c["bytes"] = pd.Series(wire, index=c.index, dtype=float).fillna(c["nbytes"].astype(float))
    c = c[(c["t"] > 0) & (c["bytes"] > 0) & c["op"].isin(BUS_OPS)].copy()
    factor = c["op"].map({o: float(costmodel.busbw(o, 1.0, 1.0, nproc)) for o in BUS_OPS})
    c["busbw"] = c["bytes"] / c["t"] * factor
    return c[cols].reset_index(drop=True)


def busbw_table(rows: pd.DataFrame, profile=None, nproc: int | None = None) -> pd.DataFrame:
    """The median bus bandwidth (bytes/s) per bucket (DDP) or per op (collectives), with how many rows it is over
    (`n`), and `calibrated` (bytes/s): the bus bandwidth the profile's fitted beta gives for that op on nproc ranks
    (NaN without a profile or a fit of that op)."""
    cols = ["what", "op", "busbw", "n", "calibrated"]
    if rows.empty:
        return pd.DataFrame(columns=cols)
    key = "bucket" if "bucket" in rows.columns and rows["bucket"].notna().all() else "op"
    g = rows.groupby(list(dict.fromkeys([key, "op"])))["busbw"].agg(["median", "size"]).reset_index()
    what = g[key].map(lambda k: f"bucket {int(k)}" if key == "bucket" else str(k))
    cal = g["op"].map(lambda o: calibrated_busbw(profile, o, nproc))
    return pd.DataFrame({"what": what, "op": g["op"], "busbw": g["median"], "n": g["size"], "calibrated": cal})


def calibrated_busbw(profile, op: str, nproc: int | None) -> float:
    """The bus bandwidth (bytes/s) of `profile`'s fitted beta for `op` on `nproc` ranks; NaN when there is no
    profile, no fit of that op or no world size."""
    if profile is None or not nproc or nproc < 2 or op not in getattr(profile, "fits", {}):
        return float("nan")
    return float(bus_bandwidth(profile.fits[op], nproc))


def calibration_label(profile, table: pd.DataFrame) -> str:
    """'no calibration', or the calibrated bus bandwidth per op ('calibrated all_reduce: 1.2 GB/s (1/beta)')."""
    if profile is None:
        return "no calibration"
    cal = table.dropna(subset=["calibrated"]).drop_duplicates("op") if not table.empty else table
    if cal.empty:
        return "no calibration of " + (", ".join(sorted(set(table["op"]))) if not table.empty else "these ops")
    return "; ".join(f"calibrated {r.op}: {fmt_gbps(r.calibrated)} (bus, from 1/beta)" for r in cal.itertuples())


def recent(series: pd.Series, last: int = 10) -> float:
    """The median of the last `last` values (NaN when there are none)."""
    v = series.dropna().to_numpy(dtype=float)[-last:]
    return float(np.median(v)) if v.size else float("nan")


def live_view(live, profile=None, state: str = "running", why: str = "", now: float | None = None) -> dict:
    """Everything the monitor shows, from `live` (a dtlab.results.live.LiveRun after a poll): state and why
    (the state's reason, e.g. the failed rank), elapsed_s (s since the launch to `now`, a wall time; without one,
    to this moment while running and to the last step's record once ended; None when the launch time is not
    recorded), step (the last step every rank recorded;
    -1 before the first),
    steps (the run's step count), table (`step_table`), pairs (`exposed_pairs`), ranks (`rank_times`), straggler,
    busbw (`busbw_rows` of the measured steps, steps >= warmup once there are any), bw_table (`busbw_table`),
    calibration (`calibration_label`), baseline_steps, unpaired (no-op steps recorded without a pairing), errors
    ({rank: {error, step}}), torn and damaged (lines so far), nproc. What it derives from steps every rank has
    passed is kept for the next view (`derived`): a redraw of a long run computes only its newest steps."""
    p = live.nproc
    table, ranks, bw, last = derived(live) if settles(live) else from_frames(live)
    measured = not table.empty and bool((table["step"] >= live.warmup).any())
    bw_table = busbw_table(bw, profile, p)
    baseline = live.frame("baseline_step")
    # the watcher's clock while it watches (`now`: this moment, or time.time() while running); a record shown after
    # the fact (a replay): its last step's record (NaN: not recorded)
    end = now if now is not None else time.time() if state == "running" else last
    return {
        "state": state,
        "why": why,
        "elapsed_s": end - float(live.launched) if live.launched and end == end else None,
        "step": int(table["step"].max()) if not table.empty else -1,
        "steps": live.steps,
        "baseline_steps": live.baseline_steps,
        "unpaired": int(baseline["paired_step"].isna().sum()),
        "nproc": p,
        "table": table,
        "pairs": exposed_pairs(baseline, table, p),
        "ranks": ranks,
        "straggler": straggler(ranks[ranks["step"] >= live.warmup] if measured else ranks),
        "busbw": bw,
        "bw_table": bw_table,
        "calibration": calibration_label(profile, bw_table),
        "errors": dict(live.errors),
        "torn": live.torn,
        "damaged": len(live.damage),
    }


def from_frames(live) -> tuple:
    """(table, ranks, busbw rows, the last step's wall time) from every row `live` has read: what `derived` gives,
    computed again from the start (a restarted run, a step recorded twice, an unknown world size)."""
    f = live.frames()
    table, ranks, bw, _ = _derive(f["step"], f["bucket"], f["collective"], live, split=False)
    measured = set(table["step"][table["step"] >= live.warmup])
    if measured and not bw.empty:
        bw = bw[bw["step"].isin(measured)].reset_index(drop=True)
    last = float(f["step"]["time"].max()) if not f["step"].empty else math.nan
    return table, ranks, bw, last


def _derive(steps, buckets, collectives, live, split: bool) -> tuple:
    """(step_table, rank_times, busbw rows, other busbw rows) of these rows; `split`: the busbw rows of the table's
    steps >= warmup first, the others (warm-up or incomplete steps) last; else all first, none last."""
    p = live.nproc
    comm = comm_intervals(buckets, collectives)
    table = step_table(steps, comm, p)
    ranks = rank_times(steps, buckets, p)
    rows = [busbw_rows(buckets, p, live.bucket_op)] if live.bucket_op else []
    rows.append(busbw_rows(collectives.dropna(subset=["step"]), p))
    bw = _joined(rows)
    if not split or bw.empty:
        return table, ranks, bw, bw.iloc[:0]
    inside = bw["step"].isin(set(table["step"][table["step"] >= live.warmup])).to_numpy()
    return table, ranks, bw[inside].reset_index(drop=True), bw[~inside].reset_index(drop=True)


def _joined(frames: list) -> pd.DataFrame:
    """The non-empty frames, one after another (the first frame, empty, when all are)."""
    full = [f for f in frames if not f.empty]
    return pd.concat(full, ignore_index=True) if len(full) > 1 else (full[0] if full else frames[0])


def settles(live) -> bool:
    """True when a redraw may keep what it derived from settled steps (`derived`): the world size is known, no
    attempt was restarted and no rank recorded a step twice (each would make an old step's rows change), and
    `live.view_cache` is not False (False: every redraw computes everything again)."""
    return bool(live.nproc) and not live.restarted and not live.redone and live.view_cache is not False


SETTLED = ("step", "bucket", "collective")
SETTLE_ROWS = 2000
"""Step records (steps x ranks) a redraw lets settle at once: fewer are computed with the newest steps, so a short
run's view costs what one computation of all its rows does."""


def derived(live) -> tuple:
    """`from_frames`, kept between redraws. A step is settled once every rank has recorded a later step: a rank
    writes its events in order, so no row of a settled step is still to come, and its rows of the step table, the
    ranks' times and the bus bandwidth are computed once, when it settles (SETTLE_ROWS records at a time), then kept
    (`live.view_cache`); each redraw computes only the steps not settled yet. Bus bandwidth rows come in the order
    their steps settled."""
    c = live.view_cache
    if c is None:
        c = live.view_cache = {"used": dict.fromkeys(SETTLED, 0), "pool": {}, "kept": None, "early": [], "last": []}
    pool = c["pool"]
    for k in SETTLED:
        new = live.chunks[k][c["used"][k] :]
        c["used"][k] = len(live.chunks[k])
        if new or k not in pool:
            pool[k] = append_rows(([pool[k]] if k in pool else []) + [n.drop(columns="attempt") for n in new], _cols(k))
    bound = min(live.last_step.get(r, -1) for r in range(live.nproc))
    done = {k: pool[k]["step"].to_numpy(dtype=float) < bound for k in SETTLED}
    if done["step"].sum() >= SETTLE_ROWS:
        old = {k: pool[k][done[k]] for k in SETTLED}
        got = _derive(old["step"], old["bucket"], old["collective"], live, split=True)
        c["kept"] = got[:3] if c["kept"] is None else tuple(_joined([a, b]) for a, b in zip(c["kept"], got[:3]))
        c["early"].append(got[3])
        c["last"].append(float(old["step"]["time"].max()) if not old["step"].empty else math.nan)
        for k in SETTLED:
            pool[k] = pool[k][~done[k]].reset_index(drop=True)
    tail = _derive(pool["step"], pool["bucket"], pool["collective"], live, split=False)
    kept = c["kept"] or tuple(t.iloc[:0] for t in tail[:3])
    table, ranks = _joined([kept[0], tail[0]]), _joined([kept[1], tail[1]])
    measured = set(tail[0]["step"][tail[0]["step"] >= live.warmup])
    if measured or (not kept[0].empty and bool((kept[0]["step"] >= live.warmup).any())):  # only measured steps' rows
        bw = _joined([kept[2], tail[2][tail[2]["step"].isin(measured)].reset_index(drop=True)])
    else:
        bw = _joined([*c["early"], tail[2]])
    times = [*c["last"], float(pool["step"]["time"].max()) if not pool["step"].empty else math.nan]
    return table, ranks, bw, max((t for t in times if t == t), default=math.nan)


def _cols(kind: str) -> list[str]:
    return [c for c in KEEP[kind] if c != "attempt"]


def text_line(view: dict) -> str:
    """One compact line of the monitor for a terminal: the time since the launch, step k of N with its share,
    loss, T_step (ms, slowest rank, median of the last 10 complete steps: which steps, said), communication share
    (%, the same steps), exposed (ms, median of the last 10 pairs, only with pairs), bus bandwidth (GB/s, with its
    calibration or 'no calibration'), the straggler, and the state when it is not 'running'. `view` is what
    `live_view` returns."""
    n = view.get("steps")
    done = view["step"] + 1
    progress = f"{done} steps" + (f" of {n} ({done / n:.0%})" if n else "")
    if done == 0:
        progress = "no complete step yet" + (f" (0 of {n})" if n else "")
    elapsed = view.get("elapsed_s")
    t, parts = view["table"], ([f"{fmt_clock(elapsed)} elapsed"] if elapsed is not None else []) + [progress]
    if not t.empty:
        last = t["step"].to_numpy()[-10:]
        window = f"step {last[0]}" if len(last) == 1 else f"steps {last[0]}-{last[-1]}"
        parts.append(f"loss {t['loss'].iloc[-1]:.4g}")
        parts.append(f"T_step {fmt_ms(recent(t['t_step']))} (slowest rank, median of {window})")
        share = recent(t["comm_share"])
        if share == share:
            parts.append(f"comm {share:.0%} of T_step ({window})")
    pairs = view["pairs"]
    if not pairs.empty:
        k, e = min(len(pairs), 10), recent(pairs["exposed"])
        of = f"median of the last {k} pair{'s' if k > 1 else ''}"
        parts.append(f"exposed {fmt_ms(e)} ({of})" if e >= 0 else f"exposed: noise ({of} is {fmt_ms(e)}, below 0)")
    bw, table = view["busbw"], view["bw_table"]
    if not bw.empty and table["what"].str.startswith("bucket").all():  # one op: the median over every bucket
        parts.append(f"busbw {fmt_gbps(float(bw['busbw'].median()))} ({view['calibration']})")
    elif not bw.empty:  # collectives: one median per op (an all-gather and a reduce-scatter are not one figure)
        each = ", ".join(f"{r.op} {fmt_gbps(r.busbw)}" for r in table.itertuples())
        parts.append(f"busbw {each} ({view['calibration']})")
    s = view["straggler"]
    if s:
        parts.append(f"straggler rank {s['rank']} (+{fmt_ms(s['gap_s'])})")
    if view["state"] != "running":
        parts.append(view["state"] + (f": {view['why']}" if view.get("why") else ""))
    return "dtlab watch: " + " | ".join(parts)


def fmt_clock(seconds: float) -> str:
    """Elapsed time as a clock reads it: '0:07', '12:03', '1:02:03'."""
    s = max(0, int(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"
