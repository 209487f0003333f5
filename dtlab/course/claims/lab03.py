"""The claims lab 3 prints: during training an all-reduce takes longer than alone, as the loaded calibration
measured; the what-if model beside the measured sweep, cap by cap (dtlab.course.claims)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtlab.course.claims import compare, spread


def contention_claim(pred: pd.DataFrame, how: str):
    """'During training an all-reduce takes longer than in isolation: it shares the machine with backward compute',
    from dtlab.predict rows of a loaded profile: the measured T_comm of each step beside the contended replay (the
    loaded fit while backward runs, the idle fit after), with the idle replay's ratio for the gap contention
    closes."""
    rows = pred.dropna(subset=["contended_t_comm"])
    measured, contended, idle = (rows[c].tolist() for c in ("measured_t_comm", "contended_t_comm", "predicted_t_comm"))
    gap = spread([m / i for m, i in zip(measured, idle) if i])

    def why(outcome):
        return (
            f"with every bucket at its idle price the replay's T_comm is ×{1 / gap.median:.3g} of the measured; "
            "priced under load it is the ratio above. What is left is what the loaded calibration does not "
            "reproduce: its load is one backward pass replayed on every rank, while in training the ranks also "
            "wait for each other (a rank that starts an all-reduce first counts its wait) and compute slows "
            "down in turn while gloo's threads run."
        )

    return compare(
        "lab03.contention",
        "during training an all-reduce takes longer than alone: it shares the cores "
        "(on a GPU, the SMs) with backward compute, as the loaded calibration measured",
        "T_comm per step",
        ("measured", measured),
        ("contended replay", contended),
        expected=1.0,
        model="the replay with each bucket priced by the loaded fit while backward runs, the idle fit "
        f"after; the idle replay is ×{gap.median:.3g} (range ×{gap.lo:.3g} .. ×{gap.hi:.3g}) "
        "below the measurement",
        rel_tol=0.3,
        why=why,
        how=how,
        per="step",
    )


def whatif_claim(compare_df: pd.DataFrame, how: str):
    """'The what-if model predicts T_step at each bucket cap within the measured spread', from lab 3's table of the
    sweep: per cap the what-if's T_step (`whatif_t_step_ms`) beside the run's median T_step (`measured_t_step_ms`)
    and its 90% interval over steps (`measured_lo_ms` .. `measured_hi_ms`). The band is the median over caps of
    the interval's half-width over the median: the spread of the measurement itself."""
    rows = compare_df.dropna(subset=["whatif_t_step_ms", "measured_t_step_ms", "measured_lo_ms", "measured_hi_ms"])
    measured = (rows["measured_t_step_ms"] / 1e3).tolist()
    predicted = (rows["whatif_t_step_ms"] / 1e3).tolist()
    half = ((rows["measured_hi_ms"] - rows["measured_lo_ms"]) / 2 / rows["measured_t_step_ms"]).tolist()
    band = float(np.median(half)) if half else 0.0
    err = [p / m - 1 for p, m in zip(predicted, measured)]
    worst = int(np.argmax(np.abs(err))) if err else 0
    inside = sum(lo <= p * 1e3 <= hi for p, lo, hi in zip(predicted, rows["measured_lo_ms"], rows["measured_hi_ms"]))

    def why(outcome):
        cap = rows["bucket_mb"].iloc[worst] if len(rows) else float("nan")
        return (
            f"{inside} of {len(err)} caps have the prediction inside their run's own 90% interval; the largest miss "
            f"is {err[worst]:+.0%} at {cap:g} MiB. The what-if keeps the reference run's compute and wait and prices "
            "each bucket with the idle fit: it does not follow a run whose compute moved with the machine's load "
            "(the sweep's runs are single runs, made one after another: compare their T_comp), nor all-reduces "
            "slowed by backward compute on the same cores beyond what the reference run waited (the contention claim "
            "below)."
        )

    return compare(
        "lab03.whatif",
        "the what-if model, fed with one run's compute and the calibrated alpha and beta, predicts T_step at "
        "every bucket cap within the spread of the measured steps",
        "T_step per bucket cap",
        ("what-if", predicted),
        ("measured", measured),
        expected=1.0,
        model="run.whatif of the reference run (its compute, readiness, cores and wait) on the profile's link (the "
        "calibration's contention, stretch and lone-rank figures: dtlab.model.link, dtlab.model.sharing); the band "
        f"±{band:.0%} is the median half-width of the runs' 90% intervals of T_step",
        rel_tol=band,
        why=why,
        how=how,
        per="bucket cap",
    )
