"""The claims lab 9 prints (dtlab.course.claims), each built from the lever runs on screen: what local SGD, the
asynchronous server and PowerSGD do to the bytes and to the steps to a target accuracy, and whether time to accuracy
is steps to accuracy times T_step. Also the tables the lab shows, from the same runs and the same model.

The runs are a dict label -> Run with the labels of dtlab.course.rubric.lab09 (baseline, local SGD, async,
PowerSGD); `target` is the held-out accuracy the lab aims at.
"""

from __future__ import annotations

import pandas as pd

from dtlab.config.strategies import strategy_spec
from dtlab.course.claims import compare
from dtlab.results.convergence import bytes_per_step, update_interval
from dtlab.units import fmt_time


def _t_step(run) -> float:
    """The measured seconds per optimizer step: the summary's T_step; for the asynchronous server, the median
    training time between two applied updates (one server step)."""
    if strategy_spec(run.config.strategy).asynchronous:
        return update_interval(run)
    return float(run.summary().set_index("quantity").loc["T_step", "value"])


def steps_or_more(run, target: float) -> tuple[int, bool]:
    """(steps to `target`, reached?): a run that never reached it counts as one evaluation past its last."""
    s = run.steps_to(target)
    if s is not None:
        return s, True
    last = int(run.evals["step"].max()) if not run.evals.empty else 0
    return last + int(run.config.evaluation.every or 1), False


#: the bytes column's name: a mean over all of a run's steps, its first (warm-up, uncompressed) steps included
BYTES_COLUMN = "bytes per step (mean over all steps)"


def fmt_mean_bytes(x: float) -> str:
    """A mean byte count as the table and the claims show it: exact when whole, else one decimal."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def lever_table(
    runs: dict, target: float, predicted: pd.DataFrame | None = None, composed: bool = False
) -> pd.DataFrame:
    """One row per lever: bytes per step (one rank; a mean over every step of the run, warm-up included, e.g.
    PowerSGD's uncompressed first steps), steps to `target`, measured T_step (ms; per update for async), the
    measured time to target (s), and the model's T_step and time when `predicted`
    (dtlab.model.convergence.time_to_target) is given. `composed`: also each lever's own steps x T_step (s), the
    composition a question builds on: leave it False until that question has been checked."""
    rows = []
    pred = predicted.set_index("label") if predicted is not None else None
    for label, run in runs.items():
        steps, t = run.steps_to(target), run.time_to(target)
        ts = _t_step(run)
        never = "not reached"  # a table cell, never a NaN
        row = {
            "lever": label,
            BYTES_COLUMN: fmt_mean_bytes(bytes_per_step(run)),
            "steps to target": steps if steps is not None else never,
            "T_step measured (ms)": f"{ts * 1e3:.2f}",
        }
        if composed:
            row["steps x T_step (s)"] = f"{steps * ts:.3f}" if steps is not None else never
        row["time to target measured (s)"] = f"{t:.3f}" if t is not None else never
        if pred is not None and label in pred.index:
            row["T_step model (ms)"] = f"{float(pred.loc[label, 't_step']) * 1e3:.2f}"
            tm = pred.loc[label, "time"]
            row["time to target model (s)"] = never if pd.isna(tm) else f"{float(tm):.3f}"
        rows.append(row)
    return pd.DataFrame(rows)


def local_bytes_claim(runs: dict, local: str, baseline: str, h: int):
    """'Local SGD with H moves 1/H of the bytes', from the byte counts (exact)."""
    return compare(
        "lab09.local_bytes",
        f"local SGD with H = {h} moves 1/H of the bytes of synchronous DDP",
        "bytes per rank and step (mean over all steps)",
        (local, [bytes_per_step(runs[local])]),
        (baseline, [bytes_per_step(runs[baseline])]),
        expected=1 / h,
        model="one all-reduce of every parameter per H steps against every gradient each step",
        unit="B",
        rel_tol=0.01,
        how="byte counts are exact",
    )


def powersgd_claim(runs: dict, psgd: str, baseline: str, target: float):
    """'PowerSGD reaches the target later (in steps) than the uncompressed run' (Vogels et al.: error feedback
    keeps it converging, a low rank slows it)."""
    (sp, rp), (sb, rb) = steps_or_more(runs[psgd], target), steps_or_more(runs[baseline], target)
    every = int(runs[baseline].config.evaluation.every or 1)
    rank = runs[psgd].config.compression.powersgd_rank

    def why(outcome):
        return (
            f"here PowerSGD's first evaluation at or above {target:g} came at step {sp}"
            f"{'' if rp else ' (not reached: counted as one evaluation past the run)'}, the uncompressed run's "
            f"at step {sb}{'' if rb else ' (not reached)'}. Accuracy is read every {every} steps, so steps "
            f"closer than that are not told apart, and one seed is one draw: rank {rank} "
            "with error feedback lost little of the gradient on these sentences."
        )

    return compare(
        "lab09.powersgd_later",
        f"PowerSGD (rank {rank}, error feedback) reaches {target:g} later than the uncompressed run",
        f"steps to {target:g}",
        (psgd, [sp]),
        (baseline, [sb]),
        expected=None,
        model="a low-rank approximation of each gradient, its error carried to the next step",
        unit="steps",
        test="above",
        why=why,
        how=f"one run each from the same seed, evaluated every {every} steps",
    )


def staleness_claim(run, workers: int):
    """'With W workers of equal speed a gradient is about W - 1 updates stale' (each other worker's update lands
    while it is computed)."""
    u = run.updates
    applied = u[u["applied"].astype(bool)]
    mean = float(applied["staleness"].mean())

    def why(outcome):
        t = run.steps.groupby("rank")["t_step"].median()
        return (
            f"the mean staleness was {mean:.2f}: the workers' steps took {', '.join(fmt_time(v) for v in t)} "
            "(median per worker) on cores they share with the server, so they did not push in turn as equal "
            "workers would."
        )

    return compare(
        "lab09.staleness",
        f"with W = {workers} workers of equal speed a gradient is about W - 1 updates stale",
        "staleness of the applied updates",
        ("mean staleness", [mean]),
        ("W - 1", [max(workers - 1, 1e-9)]),
        expected=1.0,
        model="every other worker's update lands while one gradient is computed",
        unit="updates",
        rel_tol=0.3,
        why=why,
        how=f"{len(applied)} applied updates of one run",
    )


def composition_claim(runs: dict, target: float):
    """'Time to accuracy = steps to accuracy x T_step', lever by lever (paired), with the median T_step."""
    reached = {k: r for k, r in runs.items() if r.time_to(target) is not None}
    if not reached:
        raise ValueError(f"no lever reached {target:g}: nothing to compose")
    measured = [reached[k].time_to(target) for k in reached]
    composed = [reached[k].steps_to(target) * _t_step(reached[k]) for k in reached]

    def why(outcome):
        ratios = ", ".join(f"{k} {m / c:.2f}" for k, m, c in zip(reached, measured, composed))
        return (
            f"measured / composed per lever: {ratios}. The composition multiplies by the median step; the "
            "first steps of a run are slower (allocation, DDP's bucket rebuild), a loaded machine stretches "
            "some steps, and the time between steps (recording the events) is training time too."
        )

    return compare(
        "lab09.composition",
        f"time to {target:g} = steps to {target:g} x T_step",
        f"time to {target:g}",
        ("measured", measured),
        ("steps x median T_step", composed),
        expected=1.0,
        model="training time is the sum of its steps; the median step stands in for every step, so "
        "slower first steps (allocation, DDP's bucket rebuild) or widely spread steps move a lever "
        f"off ×1 (here ×{min(m / c for m, c in zip(measured, composed)):.2f} .. "
        f"×{max(m / c for m, c in zip(measured, composed)):.2f})",
        rel_tol=0.3,
        why=why,
        per="lever",
        how=f"paired by lever: {', '.join(reached)}",
    )


def composition_note(runs: dict, target: float) -> str:
    """Which levers reached the target within their run (step and training time), which did not (best accuracy)."""
    hit = [
        f"{k} at step {r.steps_to(target)} ({r.time_to(target):.2f} s)"
        for k, r in runs.items()
        if r.time_to(target) is not None
    ]
    miss = [f"{k} (best {r.evals['accuracy'].max():.3f})" for k, r in runs.items() if r.time_to(target) is None]
    return f"reached {target:g}: {', '.join(hit) if hit else 'none'}" + (
        f"; not reached within the run: {', '.join(miss)}" if miss else ""
    )
