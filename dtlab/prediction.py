"""Predict measured runs from a calibrated profile: `predict(run, profile)`, one row per step.

DDP: each step's buckets are replayed through a single-channel queue (dtlab.buckets.simulate_queue):
a bucket's all-reduce starts when it is ready and the previous one has finished, and lasts what the
profile predicts for its bytes. Ready times, forward and optimizer times are the run's own; backward
compute is taken to end when the last bucket became ready. So the prediction tests the communication model,
not a compute model.

ZeRO-3: each step's collectives (all-gather, reduce-scatter, all-reduce) are priced with the profile's fit
for their op; on CPU (gloo) DeepSpeed's ZeRO-3 collectives block the training thread, so the prediction adds
predicted communication to the step's measured non-communication time (T_step - T_comm). Ops the profile did
not calibrate fall back to the all-reduce fit, and the `ops_priced_with` column says so.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .buckets import predict_step
from .results import _union_length

COLUMNS = ["step", "rank", "measured_t_step", "predicted_t_step", "measured_t_comm", "predicted_t_comm",
           "measured_exposed", "predicted_exposed", "t_step_error", "t_comm_error"]


def predict(run, profile) -> pd.DataFrame:
    """One row per measured step: measured vs predicted T_step (slowest rank), T_comm (rank where longest) and exposed
    communication in seconds, and the relative errors (predicted - measured) / measured."""
    if run.config.get("strategy", "ddp") == "zero3":
        df = _predict_zero3(run, profile)
    else:
        df = _predict_ddp(run, profile)
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    df["t_step_error"] = df["predicted_t_step"] / df["measured_t_step"] - 1
    df["t_comm_error"] = df["predicted_t_comm"] / df["measured_t_comm"].replace(0, np.nan) - 1
    return df


def _slowest(run) -> pd.DataFrame:
    st = run.measured_steps()
    return st.loc[st.groupby("step")["t_step"].idxmax()]


def _predict_ddp(run, profile) -> pd.DataFrame:
    rows = []
    p = run.nproc
    for s in _slowest(run).itertuples():
        b = run.buckets[(run.buckets["rank"] == s.rank) & (run.buckets["step"] == s.step)].sort_values("t_ready")
        if b.empty:
            continue
        ready = b["t_ready"].to_numpy()
        durations = np.asarray(profile.predict("all_reduce", b["nbytes"].to_numpy(), p), dtype=float)
        bwd_comp = float(ready.max()) - s.t_fwd
        pred = predict_step(s.t_fwd, bwd_comp, s.t_opt, ready, durations)
        rows.append({"step": s.step, "rank": s.rank, "measured_t_step": s.t_step,
                     "predicted_t_step": pred["t_step"], "measured_t_comm": _longest_comm(run.buckets, s.step),
                     "predicted_t_comm": pred["t_comm"],
                     "measured_exposed": s.t_fwd + s.t_bwd - float(ready.max()),
                     "predicted_exposed": pred["exposed"], "n_buckets": len(b)})
    return pd.DataFrame(rows)


def _predict_zero3(run, profile) -> pd.DataFrame:
    rows = []
    p = run.nproc
    fitted = set(profile.fits)
    for s in _slowest(run).itertuples():
        c = run.collectives[(run.collectives["rank"] == s.rank) & (run.collectives["step"] == s.step)]
        if c.empty:
            continue
        pred_comm, used = 0.0, set()
        for op, g in c.groupby("op"):
            fit_op = op if op in fitted else "all_reduce"
            used.add(f"{op}->{fit_op}")
            pred_comm += float(np.sum(profile.predict(fit_op, g["nbytes"].to_numpy(), p)))
        meas_comm = _longest_comm(run.collectives, s.step)
        rows.append({"step": s.step, "rank": s.rank, "measured_t_step": s.t_step,
                     "predicted_t_step": s.t_step - meas_comm + pred_comm, "measured_t_comm": meas_comm,
                     "predicted_t_comm": pred_comm, "measured_exposed": meas_comm, "predicted_exposed": pred_comm,
                     "n_collectives": len(c), "ops_priced_with": ", ".join(sorted(used))})
    return pd.DataFrame(rows)


def _longest_comm(intervals: pd.DataFrame, step: int) -> float:
    """T_comm of a step as Run.summary defines it: the in-flight union on the rank where it is longest."""
    d = intervals[intervals["step"] == step]
    return float(max((_union_length(g) for _, g in d.groupby("rank")), default=0.0))


def prediction_summary(pred: pd.DataFrame) -> dict:
    """Median absolute relative errors of T_step and T_comm over the steps (fractions)."""
    return {"median_abs_t_step_error": float(pred["t_step_error"].abs().median()),
            "median_abs_t_comm_error": float(pred["t_comm_error"].abs().median()), "steps": len(pred)}
