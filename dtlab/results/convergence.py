"""Held-out accuracy and the asynchronous server's updates, read from a run directory's events. Pure.

- `evals`: one row per evaluation: step (optimizer steps done; the server's version for 'async'), t (training
  time in s since the first step began, evaluations left out), accuracy, loss (held-out mean cross-entropy),
  t_eval (s the evaluation took), t_wall (s since the first step, everything included), n (sentences).
- `updates` ('async'): one row per pushed gradient the server took: rank (the worker that pushed it), step (the
  worker's step), staleness (server updates between its pull and this push), applied, version (after it),
  computed_on, t (the server's training time, s), lr, loss (the worker's).
- `time_to(target)`, `steps_to(target)`: the first evaluation at or above `target` (seconds of training time,
  optimizer steps), or None when the run never reached it.
- `bytes_per_step`: what a run moved per optimizer step and rank, from whatever it records (buckets' bytes on
  the wire, local SGD's averages, the asynchronous worker's push and pull).
"""

from __future__ import annotations

import pandas as pd

from dtlab.units import fmt_bytes_exact

EVAL_COLUMNS = ["step", "t", "accuracy", "loss", "t_eval", "t_wall", "n"]
UPDATE_COLUMNS = ["rank", "step", "staleness", "applied", "version", "computed_on", "t", "lr", "loss"]


def evals_frame(rows: list[dict]) -> pd.DataFrame:
    """The `eval` events as a frame (one rank writes them), sorted by step."""
    df = pd.DataFrame(rows)
    for c in EVAL_COLUMNS:
        if c not in df.columns:
            df[c] = pd.Series(dtype=float)
    df = df[EVAL_COLUMNS].sort_values("step", kind="stable").reset_index(drop=True)
    return df


def updates_frame(rows: list[dict]) -> pd.DataFrame:
    """The server's `update` events as a frame: `rank` is the worker that pushed (the event's `worker`)."""
    df = pd.DataFrame([{**{k: v for k, v in r.items() if k != "rank"}, "rank": r.get("worker")} for r in rows])
    for c in UPDATE_COLUMNS:
        if c not in df.columns:
            df[c] = pd.Series(dtype=float)
    return df[UPDATE_COLUMNS].reset_index(drop=True)


def first_at(evals: pd.DataFrame, target: float, column: str):
    """`column` of the first evaluation whose accuracy is at least `target`, or None."""
    if not 0 < target <= 1:
        raise ValueError(f"target must be an accuracy in (0, 1], got {target!r}")
    hit = evals[evals["accuracy"] >= target]
    if hit.empty:
        return None
    v = hit.iloc[0][column]
    return int(v) if column == "step" else float(v)


def staleness_histogram(updates: pd.DataFrame) -> pd.DataFrame:
    """Applied and dropped updates per staleness: columns staleness, applied, dropped."""
    if updates.empty:
        return pd.DataFrame(columns=["staleness", "applied", "dropped"])
    u = updates.assign(applied=updates["applied"].astype(bool))
    g = u.groupby("staleness")["applied"]
    return pd.DataFrame({"applied": g.sum().astype(int), "dropped": (g.count() - g.sum()).astype(int)}).reset_index()


def bytes_per_step(run) -> float:
    """Bytes one rank moved per optimizer step, averaged over the run's measured and warm-up steps: every recorded
    bucket's bytes on the wire (DDP, compression hooks), local SGD's parameter averages and an asynchronous worker's
    push and pull, summed per rank and divided by that rank's steps; the median over ranks."""
    st = run.steps
    if st.empty:
        return float("nan")
    frames = []
    if not run.buckets.empty:
        b = run.buckets
        col = "wire_bytes" if "wire_bytes" in b.columns else "nbytes"
        frames.append(b[["rank"]].assign(nbytes=b[col].fillna(b["nbytes"])))
    if not run.collectives.empty:
        frames.append(run.collectives[["rank", "nbytes"]])
    steps = st.groupby("rank")["step"].nunique()
    if not frames:
        return 0.0
    moved = pd.concat(frames).groupby("rank")["nbytes"].sum()
    per = moved.reindex(steps.index).fillna(0) / steps
    return float(per.median())


def update_interval(run) -> float:
    """The asynchronous server's median seconds of training time between two applied updates."""
    u = run.updates
    if u.empty:
        return float("nan")
    t = u[u["applied"].astype(bool)]["t"].astype(float).sort_values()
    return float(t.diff().dropna().median()) if len(t) > 1 else float("nan")


def convergence_lines(run) -> list[str]:
    """Lines for the run's printed table: held-out accuracy, local SGD's averages, the server's staleness."""

    out = []
    ev = run.evals
    if not ev.empty:
        first, last, best = ev.iloc[0], ev.iloc[-1], ev.loc[ev["accuracy"].idxmax()]
        out.append(
            f"  held-out accuracy {first['accuracy']:.3f} at step {int(first['step'])} -> {last['accuracy']:.3f} "
            f"at step {int(last['step'])} (best {best['accuracy']:.3f} at step {int(best['step'])}, "
            f"{len(ev)} evaluations of {int(last['n'])} sentences, {ev['t_eval'].median() * 1e3:.0f} ms each, "
            "outside the timed steps)"
        )
        for target in (0.8, 0.9):
            t = run.time_to(target)
            out.append(
                f"  time to {target:g}: "
                + (f"{t:.2f} s of training, {run.steps_to(target)} steps" if t is not None else "not reached")
            )
    local = int(run.config.sync.local_sgd)
    if local and not run.collectives.empty:
        avg = run.collectives[(run.collectives["rank"] == 0) & (run.collectives["phase"] == "average")]
        if not avg.empty:
            out.append(
                f"  local SGD H = {local}: {len(avg)} parameter averages of {fmt_bytes_exact(avg['nbytes'].iloc[0])}"
                f" in {run.steps['step'].nunique()} steps ({fmt_bytes_exact(bytes_per_step(run))} per step)"
            )
    if not run.updates.empty:
        h = staleness_histogram(run.updates)
        out.append(
            "  staleness of applied updates: "
            + ", ".join(f"{int(r.staleness)}: {int(r.applied)}" for r in h.itertuples() if r.applied)
            + f"; dropped {int(h['dropped'].sum())} (max_staleness {run.config.sync.max_staleness}, "
            f"policy {run.config.sync.staleness_policy})"
        )
    return out
