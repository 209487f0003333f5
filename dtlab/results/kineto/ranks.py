"""One rank's trace file as numpy columns, classified with dtlab's definitions: its ProfilerSteps, compute
intervals (kernels, or CPU operations for a CPU-only trace), kernel launches and collectives (NCCL kernels, or gloo's
own CPU spans). `rank_trace` builds one `RankTrace`; `dtlab.results.kineto.trace` joins the ranks into a `Trace`.
Pure: no torch."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

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
from dtlab.results.kineto.reader import RankColumns

COMM, COMP, MEMORY, OTHER = 0, 1, 2, 3
_MEMORY = re.compile(r"Memcpy|Memset|^dma")
_OTHER = re.compile(r"Sync$|^Stream Wait Event")
_STEP = re.compile(r"ProfilerStep\s*#\s*(\d+)")
_CPU_NOT_COMPUTE = re.compile(r"^(nccl:|gloo:|record_param_comms$|c10d::|ProfilerStep)|wait", re.IGNORECASE)


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


def first_ts(c: RankColumns):
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


def rank_trace(c: RankColumns, t0: float, rank: int, known: bool, notes: list) -> RankTrace:
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
    for name, _tid, ts, dur, meta in c.comm_cpu:
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
