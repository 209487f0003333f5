"""`load_trace(path)`: PyTorch profiler (Kineto) traces of any job, read with dtlab's definitions.

A `Trace` holds, per rank, the device activity (kernels, copies) and the CPU side that matters (the profiler's
steps, collective annotations, and for CPU-only traces the CPU operations) as numpy columns, times in seconds from
the earliest event of any rank (`t0_us` keeps that origin in the files' microseconds). It answers:

- `collectives`: one row per collective (see dtlab.results.kineto.collectives for where each field comes from);
- `breakdown()`: per rank and ProfilerStep, T_step (the step's span), T_comp and T_comm (lengths of the unions of
  compute and communication intervals launched in the step), exposed (communication time no compute covers) and
  overlap = 1 - exposed / T_comm;
- `overlap()`: per rank, Holistic Trace Analysis's comm/comp overlap (one figure for the whole trace, GPU events
  launched before the last ProfilerStep starts), so the two tools can be compared;
- `fit()`: alpha and beta from collectives matched across every rank (dtlab.results.kineto.fit).

Communication intervals are NCCL kernels; a trace without them (gloo, on CPU or on CUDA tensors) uses gloo's own
CPU spans (`gloo:all_reduce`, on gloo's threads). Compute is every other kernel (copies, sets and syncs are
neither); a trace without kernels counts the CPU operations outside collectives as compute. Pure: no torch.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dtlab.results.kineto.collectives import ROWS
from dtlab.results.kineto.fit import arrivals, bus_factor, fit_trace
from dtlab.results.kineto.ranks import COMM, COMP, RankTrace, classify, first_ts, rank_trace
from dtlab.results.kineto.reader import TraceDamaged, read_columns
from dtlab.results.kineto.text import summary_text

TRACE_SUFFIXES = (".json", ".json.gz")


def trace_files(path: str) -> list[str]:
    """The trace files at `path`: the file itself, or a folder's *.json / *.json.gz (a dtlab run directory's
    profiler/ folder when given the run directory)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"path: {path!r} is neither a trace file nor a folder")
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isdir(os.path.join(path, "profiler")):
        path = os.path.join(path, "profiler")
    files = sorted(
        p
        for p in glob.glob(os.path.join(path, "*"))
        if p.endswith(TRACE_SUFFIXES) and os.path.isfile(p) and os.path.basename(p) != "steps.json"
    )
    if not files:
        raise ValueError(f"path: {path!r} holds no trace files (*.json or *.json.gz)")
    return files


def load_trace(path: str) -> Trace:
    """Read a Kineto trace (`.json` or `.json.gz`, as `export_chrome_trace` or `tensorboard_trace_handler` write it),
    a folder of them (one per rank), or a dtlab run directory recorded with `profile=True`, into a `Trace`.

    Raises TraceDamaged (a ValueError) for a truncated or invalid file, naming the file and the position, and
    ValueError when two files claim the same rank."""
    files = trace_files(path)
    cols = [read_columns(f) for f in files]
    for c in cols:  # a dtlab run's profiler/steps.json: ProfilerStep number -> [the run's step, paired step]
        steps_json = os.path.join(os.path.dirname(c.path), "steps.json")
        if os.path.isfile(steps_json) and "dtlab_steps" not in c.info:
            with open(steps_json) as f:
                c.info["dtlab_steps"] = json.load(f)
    t0 = min((first_ts(c) for c in cols if first_ts(c) is not None), default=0.0)
    ranks, notes, seen = [], [], {}
    for i, c in enumerate(cols):
        dist = c.info.get("distributedInfo") or {}
        rank = dist.get("rank")
        if rank is None:
            notes.append(
                f"{c.path}: no rank information (no distributedInfo.rank in the trace): shown as rank "
                f"{-1 - i}, not guessed from the file name"
            )
        elif rank in seen:
            raise ValueError(f"two trace files claim rank {rank}: {seen[rank]} and {c.path}")
        else:
            seen[rank] = c.path
        ranks.append(rank_trace(c, t0, int(rank) if rank is not None else -1 - i, rank is not None, notes))
        cols[i] = None  # the columns are in numpy now: let the file's arrays go
    return Trace(path=path, ranks=sorted(ranks, key=lambda r: r.rank), t0_us=t0, notes=notes)


def interval_lengths(a_s, a_e, b_s, b_e) -> tuple[float, float, float]:
    """(|union A|, |union B|, |union A ∩ union B|) of two sets of intervals, by one sweep over their ends."""
    t = np.concatenate([a_s, a_e, b_s, b_e])
    if not len(t):
        return 0.0, 0.0, 0.0
    na, nb = len(a_s), len(b_s)
    da = np.concatenate([np.ones(na), -np.ones(na), np.zeros(2 * nb)])
    db = np.concatenate([np.zeros(2 * na), np.ones(nb), -np.ones(nb)])
    order = np.lexsort((-(da + db), t))  # at a tie, starts before ends: touching intervals stay joined
    t, ca, cb = t[order], np.cumsum(da[order]), np.cumsum(db[order])
    seg = np.diff(t)
    ina, inb = ca[:-1] > 0, cb[:-1] > 0
    return float(seg[ina].sum()), float(seg[inb].sum()), float(seg[ina & inb].sum())


@dataclass
class Trace:
    """Kineto traces read with dtlab's definitions (see the module docstring). `ranks`: one RankTrace per file,
    by rank; `notes`: what the traces did not say (no rank, no metadata), said instead of guessed."""

    path: str
    ranks: list
    t0_us: float
    notes: list = field(default_factory=list)

    @property
    def collectives(self) -> pd.DataFrame:
        """One row per collective: rank, step, op, nbytes (B), dtype, nelems, group_size, pg, seq, t_start, t_end
        (s from t0), kernel, stream (-1: a CPU span), source (kernel args, cpu annotation, cpu op (gloo), kernel
        name)."""
        frames = [r.collectives for r in self.ranks if not r.collectives.empty]
        if not frames:
            return pd.DataFrame(columns=list(ROWS))
        return pd.concat(frames, ignore_index=True)

    @property
    def steps(self) -> pd.DataFrame:
        """Every rank's profiler steps: rank, profiler_step, step, baseline, t_start, t_end (s from t0)."""
        return pd.concat([r.steps.assign(rank=r.rank) for r in self.ranks], ignore_index=True)

    def breakdown(self) -> pd.DataFrame:
        """Per rank and profiler step: T_step (the step's span, s), T_comp and T_comm (lengths of the unions of the
        compute and communication intervals launched in the step, s), exposed (T_comm not covered by compute, s),
        overlap (1 - exposed / T_comm), idle (T_step less the union of both, s), collectives (count) and baseline
        (a dtlab run's no-op-hook step)."""
        rows = []
        for r in self.ranks:
            for s in r.steps.itertuples():
                m = r.act_step == s.step
                comm, comp = m & (r.act_kind == COMM), m & (r.act_kind == COMP)
                t_comm, t_comp, both = interval_lengths(
                    r.act_start[comm], r.act_end[comm], r.act_start[comp], r.act_end[comp]
                )
                t_step = s.t_end - s.t_start
                rows.append(
                    {
                        "rank": r.rank,
                        "step": s.step,
                        "baseline": s.baseline,
                        "T_step": t_step,
                        "T_comp": t_comp,
                        "T_comm": t_comm,
                        "exposed": t_comm - both,
                        "overlap": both / t_comm if t_comm > 0 else np.nan,
                        "idle": max(0.0, t_step - (t_comm + t_comp - both)),
                        "collectives": int(((r.collectives["step"] == s.step).sum()) if not r.collectives.empty else 0),
                    }
                )
        return pd.DataFrame(
            rows,
            columns=[
                "rank",
                "step",
                "baseline",
                "T_step",
                "T_comp",
                "T_comm",
                "exposed",
                "overlap",
                "idle",
                "collectives",
            ],
        )

    def overlap(self, last_step: bool = False) -> pd.DataFrame:
        """Per rank, Holistic Trace Analysis's communication/computation overlap: (time communication kernels run
        while compute kernels run) / (time communication kernels run), over the device events launched before the
        last ProfilerStep starts (HTA drops the last step; `last_step=True` keeps it). Columns: rank, overlap_pct
        (%), comm_s and comp_s (the unions' lengths, s), rule."""
        rows = []
        for r in self.ranks:
            keep = ~np.isnan(r.act_launch)
            if not last_step and not r.steps.empty:
                keep &= r.act_launch < r.steps["t_start"].max()
            comm, comp = keep & (r.act_kind == COMM), keep & (r.act_kind == COMP)
            t_comm, t_comp, both = interval_lengths(
                r.act_start[comm], r.act_end[comm], r.act_start[comp], r.act_end[comp]
            )
            rows.append(
                {
                    "rank": r.rank,
                    "overlap_pct": 100 * both / t_comm if t_comm > 0 else np.nan,
                    "comm_s": t_comm,
                    "comp_s": t_comp,
                    "rule": "all steps" if last_step else "launched before the last ProfilerStep starts",
                }
            )
        return pd.DataFrame(rows)

    def table(self) -> pd.DataFrame:
        """The collectives grouped by op, size and group: count, median and max duration (ms), the bus bandwidth
        of the median (GB/s, nccl-tests' definition), where the metadata came from."""

        c = self.collectives
        if c.empty:
            return pd.DataFrame(
                columns=["op", "nbytes", "group_size", "count", "median_ms", "max_ms", "busbw_GBps", "source"]
            )
        c = c.assign(
            ms=(c["t_end"] - c["t_start"]) * 1e3, nbytes=c["nbytes"].fillna(-1), group_size=c["group_size"].fillna(-1)
        )
        g = c.groupby(["op", "nbytes", "group_size"], sort=True)
        out = g.agg(
            count=("ms", "size"),
            median_ms=("ms", "median"),
            max_ms=("ms", "max"),
            source=("source", lambda s: ", ".join(sorted(set(s)))),
        ).reset_index()
        bw = [
            n / (t * 1e-3) * bus_factor(op, p) / 1e9 if n > 0 and t > 0 and p > 0 else np.nan
            for op, n, p, t in zip(out["op"], out["nbytes"], out["group_size"], out["median_ms"])
        ]
        out.insert(6, "busbw_GBps", bw)
        out["nbytes"] = out["nbytes"].astype("int64")
        out["group_size"] = out["group_size"].astype("int64")
        return out

    def fit(self, form: str = "ring"):
        """Alpha and beta per collective from the collectives matched across every rank (see
        dtlab.results.kineto.fit.fit_trace): a TraceFit that says why it refused when the trace cannot support a
        fit, and shows the spread of the durations instead."""

        return fit_trace(self, form=form)

    def waits(self):
        """Per matched collective: who arrived last and how long each rank waited for it (s); see
        dtlab.results.kineto.fit.match_collectives."""

        return arrivals(self)

    def summary_text(self) -> str:
        """The breakdown (median over steps, per rank), the collectives table and the notes, as text."""

        return summary_text(self)

    def __repr__(self) -> str:
        return (
            f"Trace({self.path!r}: {len(self.ranks)} rank(s) {[r.rank for r in self.ranks]}, "
            f"{len(self.collectives)} collectives, {sum(len(r.steps) for r in self.ranks)} profiler steps)"
        )


__all__ = ["RankTrace", "Trace", "TraceDamaged", "classify", "interval_lengths", "load_trace", "trace_files"]
