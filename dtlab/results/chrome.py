"""Chrome / Perfetto trace export of a run: `dtlab trace RUN_DIR -o trace.json`, `run.to_chrome_trace()`.

Pure (no torch). The file is the Trace Event Format that chrome://tracing and ui.perfetto.dev open:

- one process per rank ("rank 0", "rank 1", ...);
- a "compute" track per rank: one slice per step ("step 3", or "step 9 (no-op baseline)" for the baseline steps
  that measure T_comp), with forward, backward and optimizer slices nested inside it (a baseline step runs no
  optimizer: dtlab.config.baseline; its optimizer slice is empty);
- "communication" tracks per rank: one slice per DDP bucket all-reduce or ZeRO-3 collective, from t_start to
  t_end, with its bytes, op, phase and bucket index as args. Intervals that overlap on one rank (a bucket queued
  behind another, ZeRO-3's prefetch) go to extra lanes ("communication 2", ...), because a trace track must nest.
  ZeRO-3's collectives inside `deepspeed.initialize` (step -1) have no step to anchor them and are left out;
- after a restart (dtlab.results.restarts): a "checkpoint" track (one slice per save), a "lost work" track (the steps an
  attempt recorded that the restarted group redid) and an instant marker where each rank restarted.

Steps are placed on the time axis by the wall clock each rank wrote when the step ended (`time` in its events,
the same clock for all ranks of one machine) minus the step's own duration; everything inside a step is
placed by the step's own clock (CUDA events on GPU), so durations are exact and step starts are good to the
time between the end of a step and its `time` stamp (well under a millisecond). Time zero is the earliest
step start of any rank.
"""

from __future__ import annotations

import json
import os

from dtlab.config.strategies import strategy_spec

COMPUTE_TID, LOST_TID, CKPT_TID, COMM_TID = 1, 2, 3, 10


def _step_times(run) -> dict[tuple[int, int, str], float]:
    """(rank, step, kind) -> wall time written at the end of the step (seconds since the epoch), from the run's
    step frames (one timeline: a step redone after a restart has its last record's)."""
    out = {}
    for kind, df in (("step", run.steps), ("baseline_step", run.baseline_steps)):
        if "time" in df.columns:
            for rank, step, t in zip(df["rank"].tolist(), df["step"].tolist(), df["time"].tolist()):
                if t == t and t is not None:
                    out[(int(rank), int(step), kind)] = float(t)
    return out


def _lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """Greedy interval partitioning: the lane of each interval so that no two in one lane overlap."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i][0])
    ends: list[float] = []
    lane = [0] * len(intervals)
    for i in order:
        s, e = intervals[i]
        for k, end in enumerate(ends):
            if s >= end:
                lane[i], ends[k] = k, e
                break
        else:
            lane[i] = len(ends)
            ends.append(e)
    return lane


def _ran(kind: str, r) -> float:
    """How long a step ran on its rank's clock (s): t_step, except for a baseline step paired with a training step
    (dtlab.config.baseline), which runs forward and backward only and counts its paired step's optimizer time."""
    paired = r.paired_step if kind == "baseline_step" else None  # a training step has none
    if paired is not None and paired == paired:
        return float(r.t_fwd + r.t_bwd)
    return float(r.t_step)


def chrome_trace(run) -> dict:
    """The run as a Trace Event Format dict (see the module docstring); times in microseconds. For a long run,
    `write_chrome_trace` writes the same JSON without holding every event at once."""
    return {"traceEvents": list(_events(run)), "displayTimeUnit": "ms", "otherData": _other_data(run)}


def _other_data(run) -> dict:
    """The trace's otherData: the run, its strategy, backend, placement and how its clock was read."""
    return {
        "run": os.path.abspath(run.path),
        "strategy": run.config.strategy,
        "backend": run.resolved.get("backend"),
        "placement": run.resolved.get("placement", {}).get("label"),
        "clock": "step starts from each rank's wall clock at step end minus t_step; "
        "slices inside a step from the step's own clock",
    }


def _events(run):
    """Every trace event of the run, one at a time, in the order the trace lists them."""
    stamps = _step_times(run)
    steps = [("step", r) for r in run.steps.itertuples()] + [
        ("baseline_step", r) for r in run.baseline_steps.itertuples()
    ]
    starts = {}
    for kind, r in steps:
        t_end = stamps.get((int(r.rank), int(r.step), kind))
        if t_end is not None:
            starts[(int(r.rank), int(r.step))] = t_end - _ran(kind, r)
    del stamps
    t0 = min(starts.values()) if starts else 0.0
    us = lambda s: round(s * 1e6, 3)  # noqa: E731
    spec = strategy_spec(run.config.strategy)
    for rank in sorted({int(r.rank) for _, r in steps}):
        yield {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        yield {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        yield {"ph": "M", "name": "thread_name", "pid": rank, "tid": COMPUTE_TID, "args": {"name": "compute"}}
    yield from _compute_events(steps, starts, t0, us)
    lanes_used: dict[int, int] = {}
    yield from _comm_events(run, spec, starts, t0, us, lanes_used)
    yield from _recovery_events(run, t0, us)
    for rank, n in lanes_used.items():
        for lane in range(n):
            yield {
                "ph": "M",
                "name": "thread_name",
                "pid": rank,
                "tid": COMM_TID + lane,
                "args": {"name": "communication" + (f" {lane + 1}" if lane else "")},
            }


def _compute_events(steps: list, starts: dict, t0: float, us):
    """One slice per step on its rank's compute track, with its forward, backward and optimizer inside (yielded
    one at a time)."""
    for kind, r in steps:
        key = (int(r.rank), int(r.step))
        if key not in starts:
            continue
        base = starts[key] - t0
        baseline = kind == "baseline_step"
        common = {"pid": key[0], "tid": COMPUTE_TID, "ph": "X"}
        yield (
            {
                **common,
                "name": f"step {key[1]}" + (" (no-op baseline)" if baseline else ""),
                "cat": "baseline" if baseline else "step",
                "ts": us(base),
                "dur": us(_ran(kind, r)),
                "args": {
                    "step": key[1],
                    "baseline": baseline,
                    "t_step_ms": r.t_step * 1e3,
                    "loss": getattr(r, "loss", None),
                },
            }
        )
        t = base
        t_opt = r.t_opt if _ran(kind, r) == r.t_step else 0.0  # a paired baseline step ran no optimizer
        for name, dur in (("forward", r.t_fwd), ("backward", r.t_bwd), ("optimizer", t_opt)):
            yield (
                {
                    **common,
                    "name": name,
                    "cat": "compute",
                    "ts": us(t),
                    "dur": us(dur),
                    "args": {"step": key[1], "baseline": baseline},
                }
            )
            t += dur


def _comm_events(run, spec, starts: dict, t0: float, us, lanes_used: dict):
    """One slice per bucket or collective, on as many communication lanes per rank as overlap needs (yielded one
    at a time); `lanes_used` gets {rank: lanes used} as they are."""
    comm = run.buckets if not run.buckets.empty else run.collectives
    if not comm.empty:
        comm = comm.dropna(subset=["t_start", "t_end"])
        for rank, g in comm.groupby("rank"):
            rows = [r for r in g.itertuples() if (int(r.rank), int(r.step)) in starts]
            ivs = [
                (starts[(int(r.rank), int(r.step))] - t0 + r.t_start, starts[(int(r.rank), int(r.step))] - t0 + r.t_end)
                for r in rows
            ]
            for r, (s, e), lane in zip(rows, ivs, _lanes(ivs)):
                lanes_used[int(rank)] = max(lanes_used.get(int(rank), 0), lane + 1)
                if spec.records == "buckets" and not run.buckets.empty:  # local SGD records collectives
                    op = "reduce+broadcast" if spec.bucket_op == "ps" else spec.bucket_op
                    name, args = (
                        f"{op} bucket {int(r.bucket)}",
                        {"op": op, "bucket": int(r.bucket), "phase": "backward", "nparams": int(r.nparams)},
                    )
                else:
                    name, args = f"{r.op} ({r.phase})", {"op": r.op, "phase": r.phase, "fn": getattr(r, "fn", None)}
                yield (
                    {
                        "ph": "X",
                        "pid": int(rank),
                        "tid": COMM_TID + lane,
                        "name": name,
                        "cat": "communication",
                        "ts": us(s),
                        "dur": us(e - s),
                        "args": {**args, "step": int(r.step), "nbytes": int(r.nbytes)},
                    }
                )


def _recovery_events(run, t0: float, us) -> list[dict]:
    """Checkpoint and restart (dtlab.results.restarts), placed by wall clock: a "checkpoint" track with one slice per
    save, a "lost work" track with the steps an attempt recorded and a restart redid, and an instant marker per
    restart."""
    ev: list[dict] = []
    named: set = set()

    def track(rank: int, tid: int, name: str) -> None:
        if (rank, tid) not in named:
            named.add((rank, tid))
            ev.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})

    for r in run.checkpoints.itertuples():
        track(int(r.rank), CKPT_TID, "checkpoint")
        ev.append(
            {
                "ph": "X",
                "pid": int(r.rank),
                "tid": CKPT_TID,
                "name": f"checkpoint step-{int(r.step)}",
                "cat": "checkpoint",
                "ts": us(r.wall_time - r.t_save - t0),
                "dur": us(r.t_save),
                "args": {"steps_done": int(r.step), "nbytes": int(r.nbytes), "attempt": int(r.attempt)},
            }
        )
    for r in run.lost.itertuples():
        track(int(r.rank), LOST_TID, "lost work (redone after a restart)")
        ev.append(
            {
                "ph": "X",
                "pid": int(r.rank),
                "tid": LOST_TID,
                "name": f"step {int(r.step)} (lost)",
                "cat": "lost",
                "ts": us(r.wall_time - r.t_step - t0),
                "dur": us(r.t_step),
                "args": {"step": int(r.step), "attempt": int(r.attempt), "loss": r.loss},
            }
        )
    for r in run.restarts.itertuples():
        ev.append(
            {
                "ph": "i",
                "s": "p",
                "pid": int(r.rank),
                "tid": COMPUTE_TID,
                "cat": "restart",
                "name": f"restart {int(r.attempt)}: resumed from step {int(r.resumed_from)}",
                "ts": us(r.wall_time - t0),
                "args": {
                    "attempt": int(r.attempt),
                    "t_load_s": r.t_load,
                    "down_s": r.down_s,
                    "checkpoint": r.checkpoint,
                },
            }
        )
    return ev


def write_chrome_trace(run, path: str) -> str:
    """Write `chrome_trace(run)` as JSON to `path`, the same bytes as `json.dump` of it, an event at a time (a long
    run's millions of events are never all in memory); returns the path. Open it in ui.perfetto.dev or
    chrome://tracing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write('{"traceEvents": [')
        chunk: list[str] = []
        for i, e in enumerate(_events(run)):
            chunk.append(json.dumps(e) if i == 0 else ", " + json.dumps(e))
            if len(chunk) >= 4096:
                f.write("".join(chunk))
                chunk.clear()
        f.write("".join(chunk))
        f.write('], "displayTimeUnit": "ms", "otherData": ' + json.dumps(_other_data(run)) + "}")
    return path
