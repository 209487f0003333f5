"""Predict measured runs from a calibrated profile: `predict(run, profile)`, one row per step.

DDP: each step's buckets are replayed through a single-channel queue (dtlab.model.buckets.simulate_queue):
a bucket's all-reduce starts when it is ready and the previous one has finished, and lasts what the
profile predicts for its bytes. Ready times, forward and optimizer times are the run's own; backward
compute is taken to end when the last bucket became ready. So the prediction tests the communication model,
not a compute model. Strategy 'ps' is replayed the same way with the profile's "ps" fit (reduce + broadcast
per bucket: calibrate with ops including "ps"; a profile without it is refused by name).

Contention: a profile calibrated with load='backward' also holds what each collective costs while a training
rank's backward pass runs beside it. Then each step is replayed twice: with the idle price throughout (the
`predicted_*` columns) and with the loaded price while backward compute runs and the idle price after it (the
`contended_*` columns, dtlab.model.buckets.simulate_queue); the gap between the two is what contention costs.
Predicted T_comm is the time in flight, the union of each bucket's [issue, end], as the recorder measures it.

ZeRO-3: each step's collectives (all-gather, reduce-scatter, all-reduce) are priced with the profile's fit
for their op (ops the profile did not calibrate fall back to the all-reduce fit; `ops_priced_with` says so),
then the rank's step is replayed on its own recorded clock (`replay_zero3`):
- compute is what was measured: T_comp = T_step - t_blocked (the time the rank was blocked on collectives);
- collectives are issued where they were issued, shifted by any extra (or saved) blocking before them, and
  run one at a time in issue order on one channel (a communicator runs its collectives in order): a
  collective starts at max(its issue, the previous one's end) and lasts what the profile predicts;
- each recorded blocked interval (a wait, a blocking call) starts where it started (shifted) and ends when
  the collectives it waited for end (never before it starts).
Predicted exposed = the union of the replayed blocked intervals; predicted T_step = T_comp + predicted
exposed; predicted T_comm = the union of the replayed [issue, end] intervals, on the rank where longest,
as measured T_comm is. Unions on both sides, never a union against a sum. Runs recorded before blocked
intervals existed are replayed as if every collective blocked from issue to end (`exposed_from` says so).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtlab.config.strategies import strategy_spec
from dtlab.intervals import frame_union_length
from dtlab.model.buckets import predict_step, replay_ranks

COLUMNS = [
    "step",
    "rank",
    "measured_t_step",
    "predicted_t_step",
    "measured_t_comm",
    "predicted_t_comm",
    "measured_exposed",
    "predicted_exposed",
    "t_step_error",
    "t_comm_error",
]
#: With a loaded profile: the same step priced with contention (loaded fit while backward runs, idle after).
CONTENDED = [
    "contended_t_step",
    "contended_t_comm",
    "contended_exposed",
    "contended_t_step_error",
    "contended_t_comm_error",
]


def predict(run, profile) -> pd.DataFrame:
    """One row per measured step: measured vs predicted T_step (slowest rank), T_comm (rank where longest) and exposed
    communication in seconds, and the relative errors (predicted - measured) / measured. `outside_fit` says
    where a step's collectives were priced outside what the profile's fits saw (sizes, process count, nodes:
    Profile.outside), '' where they stayed inside; a profile from another machine (nccl-tests) is often there."""
    spec = strategy_spec(run.config.strategy)
    if spec.records == "collectives":
        df = _predict_zero3(run, profile)
    else:
        df = _predict_ddp(run, profile)
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    df["outside_fit"] = _outside_fit(run, profile, df["step"])
    df["t_step_error"] = df["predicted_t_step"] / df["measured_t_step"] - 1
    df["t_comm_error"] = df["predicted_t_comm"] / df["measured_t_comm"].replace(0, np.nan) - 1
    if "contended_t_step" in df.columns:
        df["contended_t_step_error"] = df["contended_t_step"] / df["measured_t_step"] - 1
        df["contended_t_comm_error"] = df["contended_t_comm"] / df["measured_t_comm"].replace(0, np.nan) - 1
    return df


def _outside_fit(run, profile, steps) -> list[str]:
    """Per step: every reason its priced collectives left what the profile's fits saw (Profile.outside), joined."""
    if not hasattr(profile, "outside"):  # a stand-in that only prices (tests, what-if tables)
        return [""] * len(steps)
    spec = strategy_spec(run.config.strategy)
    nodes = (getattr(run, "resolved", None) or {}).get("nnodes", 1)
    if spec.records == "collectives":
        c = run.collectives[run.collectives["step"] >= 0]
        frames = {op: (g, g["nbytes"]) for op, g in c.groupby("op")}
    else:
        b = run.buckets
        frames = {
            spec.bucket_op: (
                b,
                b["wire_bytes"] if "wire_bytes" in b.columns and b["wire_bytes"].notna().all() else b["nbytes"],
            )
        }
    out = []
    for step in steps:
        why = set()
        for op, (g, sizes) in frames.items():
            fit_op = op if op in profile.fits else "all_reduce"
            if fit_op not in profile.fits:
                continue
            mask = (g["step"] == step).to_numpy()
            why.update(w for w in profile.outside(fit_op, sizes.to_numpy()[mask], run.nproc, nodes) if w)
        out.append(" | ".join(sorted(why)))
    return out


def _slowest(run) -> pd.DataFrame:
    st = run.measured_steps()
    return st.loc[st.groupby("step")["t_step"].idxmax()]


def _predict_ddp(run, profile) -> pd.DataFrame:
    shared = _shared_clock(run)
    if shared is not None:
        return _predict_ddp_ranks(run, profile, shared)
    rows = []
    p = run.nproc
    op = strategy_spec(run.config.strategy).bucket_op  # ps: calibrate with ops including "ps"
    for s in _slowest(run).itertuples():
        b = run.buckets[(run.buckets["rank"] == s.rank) & (run.buckets["step"] == s.step)].sort_values("t_start")
        if b.empty:
            continue
        # A compression hook encodes before it issues (t_start > t_ready) and sends wire_bytes: the bucket is
        # priced as one all-reduce of its bytes on the wire from its issue time (PowerSGD really makes two or
        # three smaller all-reduces: their extra latency terms are not priced). Without a hook, t_start = t_ready
        # and wire_bytes = nbytes.
        ready = b["t_start"].to_numpy()
        sizes = b["wire_bytes"] if "wire_bytes" in b.columns and b["wire_bytes"].notna().all() else b["nbytes"]
        durations = np.asarray(profile.predict(op, sizes.to_numpy(), p), dtype=float)
        bwd_comp = float(ready.max()) - s.t_fwd
        pred = predict_step(s.t_fwd, bwd_comp, s.t_opt, ready, durations)
        row = {
            "step": s.step,
            "rank": s.rank,
            "measured_t_step": s.t_step,
            "predicted_t_step": pred["t_step"],
            "measured_t_comm": _longest_comm(run.buckets, s.step),
            "predicted_t_comm": pred["t_comm"],
            "measured_exposed": s.t_fwd + s.t_bwd - float(ready.max()),
            "predicted_exposed": pred["exposed"],
            "n_buckets": len(b),
        }
        if profile.has_load(op):
            loaded = np.asarray(profile.predict(op, sizes.to_numpy(), p, load="backward"), dtype=float)
            con = predict_step(s.t_fwd, bwd_comp, s.t_opt, ready, durations, loaded=loaded)
            row.update(contended_t_step=con["t_step"], contended_t_comm=con["t_comm"], contended_exposed=con["exposed"])
        rows.append(row)
    return pd.DataFrame(rows)


def _shared_clock(run) -> pd.DataFrame | None:
    """Each rank-step's start on a clock shared by the ranks (seconds, `start`): the wall time the rank stamped at
    the step's end minus its duration (as the trace export places steps). None when a step lacks its stamp (a
    recording from before the stamps) or a rank has no buckets."""
    st = run.measured_steps()
    if st.empty or "time" not in st.columns or st["time"].isna().any() or run.buckets.empty:
        return None
    return st.assign(start=st["time"] - st["t_step"]).set_index(["rank", "step"])


def _sizes(b: pd.DataFrame) -> np.ndarray:
    return (b["wire_bytes"] if "wire_bytes" in b.columns and b["wire_bytes"].notna().all() else b["nbytes"]).to_numpy()


def _predict_ddp_ranks(run, profile, shared: pd.DataFrame) -> pd.DataFrame:
    """Every rank's buckets replayed together on the shared clock (dtlab.model.buckets.replay_ranks): a bucket's
    collective runs once the last rank has issued it; a rank that issued earlier waits, as it did. Each rank's
    T_step = its compute up to its last bucket, then the later of that and the last collective's end, then its
    optimizer; the prediction's T_step is the slowest rank's, its T_comm the longest rank's, as measured."""
    rows = []
    p = run.nproc
    op = strategy_spec(run.config.strategy).bucket_op  # ps: calibrate with ops including "ps"
    loaded_fit = profile.has_load(op)
    for s in _slowest(run).itertuples():
        b = run.buckets[run.buckets["step"] == s.step]
        ranks = sorted(b["rank"].unique())
        per = {r: g.sort_values("bucket") for r, g in b.groupby("rank")}
        if len({len(g) for g in per.values()}) != 1 or any((r, s.step) not in shared.index for r in ranks):
            continue
        # a compression hook encodes before it issues (t_start > t_ready) and sends wire_bytes: priced as one
        # collective of its bytes on the wire from its issue (PowerSGD's extra latency terms are not priced)
        issues = np.array([shared.loc[(r, s.step), "start"] + per[r]["t_start"].to_numpy() for r in ranks])
        ends_of_compute = issues.max(axis=1)  # each rank's backward compute: to its last bucket
        sizes = _sizes(per[ranks[0]])
        durations = np.asarray(profile.predict(op, sizes, p), dtype=float)
        row = {
            "step": s.step,
            "rank": s.rank,
            "measured_t_step": s.t_step,
            "measured_t_comm": _longest_comm(run.buckets, s.step),
            "measured_exposed": s.t_fwd + s.t_bwd - float(per[s.rank]["t_start"].max()),
            "n_buckets": len(sizes),
        }
        prices = {"predicted": (durations, None)}
        if loaded_fit:
            prices["contended"] = (durations, np.asarray(profile.predict(op, sizes, p, load="backward"), dtype=float))
        for name, (idle, loaded) in prices.items():
            rep = replay_ranks(issues, idle, loaded, None if loaded is None else float(ends_of_compute.max()))
            last = float(rep["end"][-1])
            t_opt = {r: float(shared.loc[(r, s.step), "t_opt"]) for r in ranks}
            starts = {r: float(shared.loc[(r, s.step), "start"]) for r in ranks}
            t_steps = {r: max(ends_of_compute[i], last) + t_opt[r] - starts[r] for i, r in enumerate(ranks)}
            me = ranks.index(s.rank)
            row.update(
                {
                    f"{name}_t_step": max(t_steps.values()),
                    f"{name}_t_comm": float(rep["t_comm"].max()),
                    f"{name}_exposed": max(0.0, last - float(ends_of_compute[me])),
                }
            )
        rows.append(row)
    return pd.DataFrame(rows)


def _predict_zero3(run, profile) -> pd.DataFrame:
    rows = []
    p = run.nproc
    fitted = set(profile.fits)
    measured = run.measures_blocked
    coll = run.collectives[run.collectives["step"] >= 0].dropna(subset=["t_start"])
    for s in _slowest(run).itertuples():
        step_c = coll[coll["step"] == s.step]
        if step_c[step_c["rank"] == s.rank].empty:
            continue
        used: set[str] = set()
        replays = {}
        for rank, c in step_c.groupby("rank"):
            durations = np.zeros(len(c))
            for op in c["op"].unique():
                fit_op = op if op in fitted else "all_reduce"
                used.add(f"{op}->{fit_op}")
                mask = (c["op"] == op).to_numpy()
                durations[mask] = np.asarray(profile.predict(fit_op, c["nbytes"].to_numpy()[mask], p), dtype=float)
            replays[rank] = replay_zero3(c, _blocked_of(run, c, rank, s.step, measured), durations)
        me = replays[s.rank]
        t_comp = s.t_step - me["measured_exposed"]
        rows.append(
            {
                "step": s.step,
                "rank": s.rank,
                "measured_t_step": s.t_step,
                "predicted_t_step": t_comp + me["predicted_exposed"],
                "measured_t_comm": max(r["measured_t_comm"] for r in replays.values()),
                "predicted_t_comm": max(r["predicted_t_comm"] for r in replays.values()),
                "measured_exposed": me["measured_exposed"],
                "predicted_exposed": me["predicted_exposed"],
                "measured_t_comp": t_comp,
                "n_collectives": int((step_c["rank"] == s.rank).sum()),
                "ops_priced_with": ", ".join(sorted(used)),
                "exposed_from": (
                    "measured: recorded blocked intervals"
                    if measured
                    else "assumed: every collective blocks from issue to end (no blocked intervals recorded)"
                ),
            }
        )
    return pd.DataFrame(rows)


def _blocked_of(run, c: pd.DataFrame, rank: int, step: int, measured: bool) -> pd.DataFrame:
    """The rank-step's blocked intervals (t_start, t_end, seq), or for runs without them, every collective as
    blocking from its issue to its end."""
    if measured:
        b = run.blocked
        b = b[(b["rank"] == rank) & (b["step"] == step) & (b["phase"] != "between_steps")]
        return b[["t_start", "t_end", "seq"]].dropna(subset=["t_start", "t_end"])
    c = c.dropna(subset=["t_end"])
    return pd.DataFrame(
        {"t_start": c["t_start"], "t_end": c["t_end"], "seq": c["seq"] if "seq" in c else np.arange(len(c))}
    )


def replay_zero3(collectives: pd.DataFrame, blocked: pd.DataFrame, durations) -> dict:
    """Replay one rank's step with predicted collective durations (seconds); see the module docstring.

    `collectives`: t_start (issue), t_end, seq (issue order; row order if absent), in any order;
    `durations`: predicted seconds, aligned with the rows of `collectives`; `blocked`: t_start, t_end, seq
    (the collective waited for; NaN = unknown, then the interval keeps its measured length).
    Returns measured/predicted exposed (unions of blocked intervals) and T_comm (unions of in-flight intervals).
    """
    c = collectives.assign(_d=np.asarray(durations, dtype=float))
    if "seq" not in c:
        c = c.assign(seq=np.arange(len(c)))
    c = c.sort_values(["seq"]).reset_index(drop=True)
    # Disjoint blocked segments on the measured clock, each with the collectives it waited for.
    segs: list[list] = []
    for b in blocked.sort_values("t_start").itertuples():
        seq = None if b.seq is None or b.seq != b.seq else int(b.seq)
        if segs and b.t_start <= segs[-1][1]:
            segs[-1][1] = max(segs[-1][1], b.t_end)
            segs[-1][2].append(seq)
        else:
            segs.append([b.t_start, b.t_end, [seq]])
    issue = c["t_start"].to_numpy(dtype=float)
    end_pred = np.full(len(c), np.nan)
    by_seq = {int(q): i for i, q in enumerate(c["seq"])}
    shift, chan_free, nxt, exposed = 0.0, -np.inf, 0, 0.0
    issued_at = np.full(len(c), np.nan)

    def issue_until(t):
        nonlocal nxt, chan_free
        while nxt < len(c) and issue[nxt] <= t:
            issued_at[nxt] = issue[nxt] + shift
            end_pred[nxt] = max(issued_at[nxt], chan_free) + c["_d"].iat[nxt]
            chan_free = end_pred[nxt]
            nxt += 1

    for a, b, seqs in segs:
        issue_until(a)
        a2 = a + shift
        ends = [end_pred[by_seq[q]] for q in seqs if q is not None and q in by_seq and by_seq[q] < nxt]
        b2 = max([a2] + ends) if ends else a2 + (b - a)
        exposed += b2 - a2
        shift += (b2 - a2) - (b - a)
    issue_until(np.inf)
    measured_comm = frame_union_length(c.dropna(subset=["t_end"]))
    pred = pd.DataFrame({"t_start": issued_at, "t_end": end_pred})
    return {
        "measured_exposed": float(sum(b - a for a, b, _ in segs)),
        "predicted_exposed": float(exposed),
        "measured_t_comm": float(measured_comm),
        "predicted_t_comm": float(frame_union_length(pred)),
        "shift": float(shift),
    }


def _longest_comm(intervals: pd.DataFrame, step: int) -> float:
    """T_comm of a step as Run.summary defines it: the in-flight union on the rank where it is longest."""
    d = intervals[intervals["step"] == step]
    return float(max((frame_union_length(g) for _, g in d.groupby("rank")), default=0.0))


def prediction_summary(pred: pd.DataFrame) -> dict:
    """Median absolute relative errors of T_step and T_comm over the steps (fractions); with a loaded profile also
    those of the contended prediction (`contended_*`)."""
    out = {
        "median_abs_t_step_error": float(pred["t_step_error"].abs().median()),
        "median_abs_t_comm_error": float(pred["t_comm_error"].abs().median()),
        "steps": len(pred),
    }
    if "contended_t_step_error" in pred.columns:
        out["contended_median_abs_t_step_error"] = float(pred["contended_t_step_error"].abs().median())
        out["contended_median_abs_t_comm_error"] = float(pred["contended_t_comm_error"].abs().median())
    return out
