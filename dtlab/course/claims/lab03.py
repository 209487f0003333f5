"""The claim lab 3 prints: during training an all-reduce takes longer than alone, as the loaded calibration
measured (dtlab.course.claims)."""

from __future__ import annotations

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
