"""The claim lab 1 prints: communication can only add time, T_step >= T_comp (dtlab.course.claims), judged by the
interval the breakdown prints for exposed communication (dtlab.results.breakdown)."""

from __future__ import annotations

from dtlab.course.claims import Spread, compare
from dtlab.results.breakdown import figures
from dtlab.results.spread import LEVEL
from dtlab.units import fmt_time


def exposed_claim(run):
    """'Communication can only add time: T_step >= T_comp' on a run's pairs of a training step and the no-op-hook
    step right after it (slowest rank per step; dtlab.config.baseline), judged by the 90% interval the breakdown
    prints for exposed communication (dtlab.results.breakdown): the claim holds only when the whole interval lies
    above 0, and an interval that holds 0 is inconclusive, with the noise's size as the reason. Runs recorded
    before the pairing compare all measured steps with all baseline steps, unpaired."""
    f = figures(run)
    pr = f["pairs"]
    paired = pr is not None and not pr.empty
    if paired:
        step, base = list(pr["t_step"]), list(pr["t_comp"])
    else:
        step = list(run.measured_steps().groupby("step")["t_step"].max())
        base = list(run.baseline_steps.groupby("step")["t_step"].max())
    t_step, exposed = f["t_step"], f["exposed"]
    e_lo, e_hi = f["exposed_iv"]

    def ratio(e):  # T_step / T_comp with T_comp = T_step - e: above 1 exactly when e is above 0 (at most 1000)
        return t_step / max(t_step - e, t_step / 1000)

    lo, hi = min(e_lo, exposed), max(e_hi, exposed)
    ratios = Spread(ratio(exposed), ratio(lo), ratio(hi), f["n_diff"])
    busy = f["machine"]["line"]  # the breakdown's word on the machine: quiet or busy (dtlab.results.busy)

    def why(outcome):
        noise = (e_hi - e_lo) / 2
        where = (
            f"over {f['n_diff']} pairs (a training step, then a no-op-hook step)"
            if paired
            else f"over {len(step)} training steps and {len(base)} baseline steps run after them (unpaired)"
        )
        if outcome == "inconclusive":
            return (
                f"the {LEVEL:.0%} interval of the exposed time {where} is {fmt_time(e_lo)} .. {fmt_time(e_hi)}: it "
                f"holds 0, so communication is below this machine's noise here (±{fmt_time(noise)}), and the "
                f"breakdown prints no exposed time or overlap as a figure. {busy}. More steps and baseline steps "
                "(steps=, baseline_steps=), or a quieter machine, narrow it."
            )
        return (
            f"the {LEVEL:.0%} interval of the exposed time {where} is {fmt_time(e_lo)} .. {fmt_time(e_hi)}: the "
            "no-op-hook steps took longer than the training steps next to them, which communication cannot "
            f"cause; something else slowed them ({busy}). The breakdown says so instead of printing a "
            "negative exposed time; more steps show whether it persists."
        )

    return compare(
        "lab01.exposed",
        "communication can only add time: a step with all-reduces takes at least as "
        "long as the same step with a no-op hook",
        "step time (slowest rank)",
        ("T_step", step),
        ("T_comp", base),
        expected=None,
        model="T_step = T_comp + exposed communication, exposed >= 0",
        test="above",
        why=why,
        per="step",
        paired=paired,
        ratios=ratios,
        interval=f"{LEVEL:.0%} interval",
        how=("pairs of a training step and the no-op-hook step after it" if paired else "unpaired")
        + f"; the ratio's interval is the breakdown's {LEVEL:.0%} interval of the exposed time",
    )
