"""A pipeline run ('pp') read back: the bubble, measured beside the theory, and the micro-batches each stage held.

The bubble of one step of one replica (P stages, the ranks of one dp coordinate):

    bubble = 1 - (sum over stages s of busy_s) / (P x T)

busy_s: the time stage s computed, the sum of its forwards and backwards (the `microbatch` events); T: the
longest of the stages' t_pipe, the time from the step's start (taken together by every stage, after a barrier)
to the end of the stage's schedule. Idle time is everything else: waiting for a neighbour's activations or
gradients (the bubble proper) and the transfers themselves. A step's bubble is the mean over replicas; the run's
is the median over measured steps (step >= warmup), with their range.

Theory (GPipe, Huang et al. 2019; 1F1B the same): (P - 1) / (M + P - 1) for M micro-batches: with equal stages,
each stage idles for P - 1 of the M + P - 1 slots of a step. It assumes stages of equal compute and transfers
that cost nothing; the measurement includes both (the first stage holds the embeddings, the last the head).
`unequal` is the theory for this run's own stages: with c_s = busy_s / M, one micro-batch's forward + backward on
stage s, a step lasts (M - 1) max_s c_s + sum_s c_s (the first micro-batch crosses every stage, the others follow
at the pace of the slowest), so its bubble is 1 - sum_s busy_s / (P x that); for equal stages it is the theory.
What separates the measurement from `unequal` is the transfers and the waits for them.

In flight: the most micro-batches whose forward a stage had run and whose backward it had not (the activations
it held at once): M for GPipe, at most P - s for 1F1B's stage s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtlab.model.parallel import bubble_fraction


def theory(stages: int, microbatches: int) -> float:
    """The bubble fraction (P - 1) / (M + P - 1) of P equal stages and M micro-batches
    (:func:`dtlab.model.parallel.bubble_fraction`)."""
    return float(bubble_fraction(stages, microbatches))


@dataclass
class Bubble:
    """`measured`: median over measured steps (fraction), `lo`/`hi` its range, `theory`, `stages` P,
    `microbatches` M, `schedule`, `steps` (one row per measured step: step, T, busy per stage, bubble), `how`;
    `unequal`: the theory for this run's unequal stages (median over steps; see the module docstring)."""

    measured: float
    lo: float
    hi: float
    theory: float
    unequal: float
    stages: int
    microbatches: int
    schedule: str
    steps: pd.DataFrame
    how: str

    def __repr__(self) -> str:
        return (
            f"Bubble(measured={self.measured:.3f} [{self.lo:.3f}..{self.hi:.3f}], theory={self.theory:.3f}, "
            f"unequal stages {self.unequal:.3f}, P={self.stages}, M={self.microbatches}, {self.schedule})"
        )


def step_bubbles(run) -> pd.DataFrame:
    """One row per (step, replica): step, dp_rank, stages, t_pipe (T, s), busy (s, summed over stages),
    bubble, unequal (the theory for these stages' busy times); and busy_s<k> / idle_s<k> per stage k (s,
    fraction of T)."""
    st, mb = run.steps, run.microbatches
    if st.empty or mb.empty or "t_pipe" not in st.columns:
        raise ValueError(f"run {run.path} recorded no pipeline (strategy 'pp' with micro-batch events)")
    busy = (mb["t_end"] - mb["t_start"]).groupby([mb["rank"], mb["step"]]).sum().rename("busy").reset_index()
    df = st[["rank", "step", "stage", "dp_rank", "t_pipe"]].merge(busy, on=["rank", "step"], how="left")
    df["busy"] = df["busy"].fillna(0.0)
    rows = []
    m = int(run.config.parallel.microbatches)
    for (step, dp), g in df.groupby(["step", "dp_rank"]):
        p, t = len(g), float(g["t_pipe"].max())
        c = g["busy"].to_numpy(dtype=float) / m
        t_model = (m - 1) * c.max() + c.sum()
        row = {
            "step": int(step),
            "dp_rank": int(dp),
            "stages": p,
            "t_pipe": t,
            "busy": float(g["busy"].sum()),
            "bubble": 1.0 - float(g["busy"].sum()) / (p * t) if t > 0 else np.nan,
            "unequal": 1.0 - float(g["busy"].sum()) / (p * t_model) if t_model > 0 else np.nan,
        }
        for r in g.itertuples():
            row[f"busy_s{int(r.stage)}"] = float(r.busy)
            row[f"idle_s{int(r.stage)}"] = 1.0 - float(r.busy) / t if t > 0 else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def bubble(run) -> Bubble:
    """The run's bubble (see the module docstring)."""
    per = step_bubbles(run)
    steps = per[per["step"] >= run.warmup].groupby("step", as_index=False)[["bubble", "unequal"]].mean()
    if steps.empty:
        raise ValueError(f"run {run.path} has no measured pipeline steps (steps >= warmup {run.warmup})")
    p = int(per["stages"].max())
    m = int(run.config.parallel.microbatches)
    vals = steps["bubble"].to_numpy(dtype=float)
    return Bubble(
        float(np.median(vals)),
        float(vals.min()),
        float(vals.max()),
        theory(p, m),
        float(steps["unequal"].median()),
        p,
        m,
        str(run.config.parallel.schedule),
        per[per["step"] >= run.warmup].reset_index(drop=True),
        f"1 - sum of the stages' busy time / (P x the longest stage's schedule), median over {len(vals)} "
        "measured steps",
    )


def in_flight(run) -> pd.DataFrame:
    """Per stage: the most micro-batches held at once in a step (forwards run, backwards not yet), max over steps."""
    mb = run.microbatches
    rows = []
    for (rank, step), g in mb.groupby(["rank", "step"]):
        held = peak = 0
        for ph in g.sort_values("t_start")["phase"]:
            held += 1 if ph == "forward" else -1
            peak = max(peak, held)
        rows.append({"rank": int(rank), "stage": int(g["stage"].iloc[0]), "step": int(step), "in_flight": peak})
    out = pd.DataFrame(rows, columns=["rank", "stage", "step", "in_flight"])
    return out.groupby("stage", as_index=False)["in_flight"].max()


def bubble_table(runs: dict) -> pd.DataFrame:
    """One row per pipeline run (label -> run): schedule, P, M, the measured bubble (median, lo, hi), the theory,
    the theory for the run's unequal stages, measured - theory, and T_step (s, the run's summary median)."""
    rows = []
    for label, run in runs.items():
        b = bubble(run)
        rows.append(
            {
                "label": label,
                "schedule": b.schedule,
                "P": b.stages,
                "M": b.microbatches,
                "measured": b.measured,
                "lo": b.lo,
                "hi": b.hi,
                "theory": b.theory,
                "unequal": b.unequal,
                "difference": b.measured - b.theory,
                "t_step": float(run.summary().set_index("quantity").loc["T_step", "value"]),
            }
        )
    return pd.DataFrame(rows)
