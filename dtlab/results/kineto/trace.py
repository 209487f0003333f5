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
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dtlab.results.kineto.collectives import (
    COMM_KERNEL,
    ROWS,
    Annotations,
    describe,
    has_meta,
    kernel_op,
)
from dtlab.results.kineto.reader import RankColumns, TraceDamaged, read_columns

COMM, COMP, MEMORY, OTHER = 0, 1, 2, 3
_MEMORY = re.compile(r"Memcpy|Memset|^dma")
_OTHER = re.compile(r"Sync$|^Stream Wait Event")
_STEP = re.compile(r"ProfilerStep\s*#\s*(\d+)")
_CPU_NOT_COMPUTE = re.compile(r"^(nccl:|gloo:|record_param_comms$|c10d::|ProfilerStep)|wait", re.IGNORECASE)
TRACE_SUFFIXES = (".json", ".json.gz")


def classify(name: str) -> int:
    """COMM (a collective kernel), MEMORY (copies and sets), OTHER (synchronisation) or COMP (everything else):
    the same classes Holistic Trace Analysis draws from kernel names."""
    if COMM_KERNEL.search(name):
        return COMM
    if _MEMORY.search(name):
        return MEMORY
    if _OTHER.search(name):
        return OTHER
    return COMP


@dataclass
class RankTrace:
    """One rank's file, reduced: `act_*` the intervals that count (device activity, or CPU work and gloo spans in a
    CPU-only trace), with kind (COMM/COMP/MEMORY/OTHER), launch time (NaN when none is known) and step (-1: none);
    `steps` a frame of the profiler's steps. Times in seconds from the trace's t0."""

    path: str
    rank: int
    rank_known: bool
    world_size: int | None
    info: dict
    act_start: np.ndarray
    act_end: np.ndarray
    act_kind: np.ndarray
    act_launch: np.ndarray
    act_step: np.ndarray
    steps: pd.DataFrame
    collectives: pd.DataFrame
    device: bool
    n_events: int = 0
    chars: int = 0


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
    t0 = min((_first_ts(c) for c in cols if _first_ts(c) is not None), default=0.0)
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
        ranks.append(_rank(c, t0, int(rank) if rank is not None else -1 - i, rank is not None, notes))
        cols[i] = None  # the columns are in numpy now: let the file's arrays go
    return Trace(path=path, ranks=sorted(ranks, key=lambda r: r.rank), t0_us=t0, notes=notes)


def _first_ts(c: RankColumns):
    """The earliest timestamp in a file (microseconds), None when it holds no events."""
    firsts = [min(a) for a in (c.dev_ts, c.rt_ts, c.cpu_ts) if len(a)] + [s[1] for s in c.steps]
    return min(firsts) if firsts else None


def _steps(c: RankColumns, t0: float) -> pd.DataFrame:
    """The ProfilerStep#N spans (seconds from t0); dtlab's own traces map each to the run's step (and say which
    are no-op baseline steps)."""
    rows = []
    mapping = c.info.get("dtlab_steps")
    if isinstance(mapping, str):
        mapping = json.loads(mapping)
    for name, ts, dur, _ in c.steps:
        m = _STEP.match(name)
        if not m:
            continue
        n = int(m.group(1))
        step, baseline = n, False
        if mapping and str(n) in mapping:
            step, paired = mapping[str(n)]
            baseline = paired is not None
        rows.append(
            {
                "profiler_step": n,
                "step": int(step),
                "baseline": baseline,
                "t_start": (ts - t0) * 1e-6,
                "t_end": (ts + dur - t0) * 1e-6,
            }
        )
    cols = ["profiler_step", "step", "baseline", "t_start", "t_end"]
    return pd.DataFrame(rows, columns=cols).sort_values("t_start", ignore_index=True)


def _assign(t: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """The step (the run's step number) whose span holds each time in `t`; -1 outside every step."""
    if steps.empty or not len(t):
        return np.full(len(t), -1, dtype=np.int64)
    s, e = steps["t_start"].to_numpy(), steps["t_end"].to_numpy()
    i = np.searchsorted(s, np.nan_to_num(t, nan=-np.inf), side="right") - 1
    ok = (i >= 0) & (t < e[np.clip(i, 0, None)])
    return np.where(ok, steps["step"].to_numpy()[np.clip(i, 0, None)], -1)


def _launches(c: RankColumns, t0: float) -> tuple[np.ndarray, np.ndarray]:
    """For each device event, the time (s) and CPU thread of the runtime call that launched it (same correlation
    id); NaN and -1 when the trace has none."""
    corr = np.frombuffer(c.dev_corr, dtype=np.int64)
    rt_corr = np.frombuffer(c.rt_corr, dtype=np.int64)
    launch, tid = np.full(len(corr), np.nan), np.full(len(corr), -1, dtype=np.int64)
    if len(rt_corr) and len(corr):
        order = np.argsort(rt_corr, kind="stable")
        sc = rt_corr[order]
        j = np.clip(np.searchsorted(sc, corr), 0, len(sc) - 1)
        hit = (sc[j] == corr) & (corr >= 0)
        src = order[j[hit]]
        launch[hit] = (np.frombuffer(c.rt_ts, dtype=np.float64)[src] - t0) * 1e-6
        tid[hit] = np.frombuffer(c.rt_tid, dtype=np.int64)[src]
    return launch, tid


def _rank(c: RankColumns, t0: float, rank: int, known: bool, notes: list) -> RankTrace:
    """One file's columns -> RankTrace, with its collectives table."""
    dist = c.info.get("distributedInfo") or {}
    world = dist.get("world_size")
    steps = _steps(c, t0)
    kinds_by_name = np.array([classify(n) for n in c.names] or [COMP], dtype=np.int8)
    ts = (np.frombuffer(c.dev_ts, dtype=np.float64) - t0) * 1e-6
    end = ts + np.frombuffer(c.dev_dur, dtype=np.float64) * 1e-6
    kind = kinds_by_name[np.frombuffer(c.dev_name, dtype=np.int32)] if len(ts) else np.zeros(0, dtype=np.int8)
    launch, launch_tid = _launches(c, t0)
    coll = _device_collectives(c, t0, rank, world, ts, end, launch, launch_tid, notes)
    device = bool(len(ts))
    if not (kind == COMM).any():  # gloo: its collectives are CPU spans on gloo's threads
        gloo = _gloo_collectives(c, t0, rank, world)
        coll = gloo if not gloo.empty else coll
        if not gloo.empty:
            ts = np.concatenate([ts, gloo["t_start"].to_numpy()])
            end = np.concatenate([end, gloo["t_end"].to_numpy()])
            kind = np.concatenate([kind, np.full(len(gloo), COMM, dtype=np.int8)])
            launch = np.concatenate([launch, gloo["t_start"].to_numpy()])
    if not device:  # CPU-only: compute is the CPU work outside collectives
        ts, end, kind, launch = _cpu_compute(c, t0, ts, end, kind, launch)
    step_of = _assign(np.where(np.isnan(launch), ts, launch), steps)
    if not coll.empty:
        coll["step"] = _assign(coll["_launch"].to_numpy(), steps)
        coll = coll.drop(columns="_launch")[list(ROWS)]
    return RankTrace(
        path=c.path,
        rank=rank,
        rank_known=known,
        world_size=world,
        info={k: v for k, v in c.info.items() if k in ("distributedInfo", "deviceProperties", "baseTimeNanoseconds")},
        act_start=ts,
        act_end=end,
        act_kind=kind,
        act_launch=launch,
        act_step=step_of,
        steps=steps,
        collectives=coll,
        device=device,
        n_events=c.n_events,
        chars=c.chars,
    )


def _cpu_compute(c, t0, ts, end, kind, launch):
    """Append the CPU operations outside collectives as compute (CPU-only traces)."""
    names = np.array([bool(_CPU_NOT_COMPUTE.search(n)) for n in c.names] or [False])
    cname = np.frombuffer(c.cpu_name, dtype=np.int32)
    keep = ~names[cname] if len(cname) else np.zeros(0, dtype=bool)
    cts = (np.frombuffer(c.cpu_ts, dtype=np.float64)[keep] - t0) * 1e-6
    cend = cts + np.frombuffer(c.cpu_dur, dtype=np.float64)[keep] * 1e-6
    return (
        np.concatenate([ts, cts]),
        np.concatenate([end, cend]),
        np.concatenate([kind, np.full(len(cts), COMP, dtype=np.int8)]),
        np.concatenate([launch, cts]),
    )


def _device_collectives(c, t0, rank, world, ts, end, launch, launch_tid, notes) -> pd.DataFrame:
    """One row per collective kernel: metadata from the kernel's arguments, else from the CPU annotation around
    its launch (found through the correlation id), else only what the kernel's name says."""
    if not c.comm_dev:
        return pd.DataFrame(columns=list(ROWS) + ["_launch"])
    ann = Annotations(c.comm_cpu)
    rows = []
    streams = np.frombuffer(c.dev_stream, dtype=np.int64)
    names = np.frombuffer(c.dev_name, dtype=np.int32)
    for i, meta in sorted(c.comm_dev.items()):
        kname = c.names[names[i]]
        source, found = "kernel args", meta
        if not has_meta(meta):
            hit = ann.around(int(launch_tid[i]), launch[i] / 1e-6 + t0) if launch_tid[i] >= 0 else None
            source, found = ("cpu annotation", hit[1]) if hit else ("kernel name", {})
            ann_name = hit[0] if hit else ""
        else:
            ann_name = meta.get("Collective name", "")
        d = describe(found, ann_name, world)
        d["op"] = d["op"] or kernel_op(kname) or "unknown"
        rows.append(
            {
                "rank": rank,
                **d,
                "t_start": ts[i],
                "t_end": end[i],
                "kernel": kname,
                "stream": int(streams[i]),
                "source": source,
                "_launch": launch[i] if launch[i] == launch[i] else ts[i],
            }
        )
    df = pd.DataFrame(rows)
    if (df["source"] == "kernel name").any():
        notes.append(
            f"{c.path}: {int((df['source'] == 'kernel name').sum())} collective kernel(s) with no metadata "
            "on the kernel or around its launch: op from the kernel's name, bytes unknown"
        )
    return df


def _gloo_collectives(c, t0, rank, world) -> pd.DataFrame:
    """gloo's collectives: its `gloo:*` spans (on gloo's own threads: the transfer itself, not the enqueue)."""
    rows = []
    for name, tid, ts, dur, meta in c.comm_cpu:
        if not name.startswith("gloo:"):
            continue
        d = describe(meta, name, world)
        d["op"] = d["op"] or "unknown"
        s = (ts - t0) * 1e-6
        rows.append(
            {
                "rank": rank,
                **d,
                "t_start": s,
                "t_end": s + dur * 1e-6,
                "kernel": name,
                "stream": -1,
                "source": "cpu op (gloo)",
                "_launch": s,
            }
        )
    return pd.DataFrame(rows, columns=[*ROWS, "_launch"])


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
        from dtlab.results.kineto.fit import bus_factor

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
        from dtlab.results.kineto.fit import fit_trace

        return fit_trace(self, form=form)

    def waits(self):
        """Per matched collective: who arrived last and how long each rank waited for it (s); see
        dtlab.results.kineto.fit.match_collectives."""
        from dtlab.results.kineto.fit import arrivals

        return arrivals(self)

    def summary_text(self) -> str:
        """The breakdown (median over steps, per rank), the collectives table and the notes, as text."""
        from dtlab.results.kineto.text import summary_text

        return summary_text(self)

    def __repr__(self) -> str:
        return (
            f"Trace({self.path!r}: {len(self.ranks)} rank(s) {[r.rank for r in self.ranks]}, "
            f"{len(self.collectives)} collectives, {sum(len(r.steps) for r in self.ranks)} profiler steps)"
        )


__all__ = ["RankTrace", "Trace", "TraceDamaged", "classify", "interval_lengths", "load_trace", "trace_files"]
