"""Lab 3 (buckets and GPU count): the bucket cap with the fastest measured T_step on 2 ranks."""

from __future__ import annotations

from dtlab.course.checks import tol_from_spread
from dtlab.course.rubric import Question
from dtlab.course.verdicts import MAX_REL_TOL, Key
from dtlab.results.run import load_run

LAB = "03_buckets_and_gpu_count"


def buckets(quick: bool) -> list[float]:
    """The lab's BUCKETS (MiB)."""
    return [0.002, 0.01, 0.03, 0.08, 1.0] if quick else [0.25, 1.0, 5.0, 25.0, 100.0]


def sources(rec) -> dict:
    """The sweep's 2-rank runs, one per cap of BUCKETS."""

    def sweep():
        return {
            b: rec.run(rec.lab_config(nproc=2, bucket_mb=b), f"lab 3's sweep run at {b:g} MiB on 2 ranks")
            for b in buckets(rec.quick)
        }

    return {"sweep": sweep}


def _runs(sweep) -> dict:
    """{bucket_mb: Run} from the notebook's sweep table (dtlab.sweep's rows with a path) or such a dict."""
    if isinstance(sweep, dict):
        return dict(sweep)

    ran = sweep[(sweep["nproc"] == 2) & sweep["status"].isin(["ran", "reused"])]
    return {float(r.bucket_mb): load_run(r.path) for r in ran.itertuples()}


def _t_step(run) -> float:
    return float(run.summary().set_index("quantity").loc["T_step", "value"])


def _best(sweep) -> Key:
    runs = _runs(sweep)
    if not runs:
        raise ValueError("the sweep has no finished 2-rank run")
    t = {b: _t_step(r) for b, r in runs.items()}
    best = min(t, key=t.get)
    spread = min(tol_from_spread(runs[best].per_step()["t_step"]), MAX_REL_TOL)
    ties = [b for b in sorted(t) if t[b] <= t[best] * (1 + spread)]
    return Key(
        "lab03.q1",
        "choice",
        ties,
        points=2,
        choices=tuple(sorted(t)),
        tol_source=f"caps within the fastest run's step-to-step spread ({spread:.0%}: half the min..max "
        "range of its per-step T_step over the median, at most 50%) count as right",
        explanation=f"fastest: {best:g} MiB at {t[best] * 1e3:.1f} ms per step; within its step-to-step spread "
        f"({spread:.0%}): {ties} MiB",
        hint="read T_step (ms) of the 2-rank runs in the sweep table above",
    )


QUESTIONS = (Question("lab03.q1", 2, "my_best_bucket_mb", ("sweep",), _best),)
