"""Claims about measurements that noise can overturn on shared cores: the labs' own numbers set side by side
with what the definitions or a rule of thumb promise (dtlab.course.claims). Re-exported by
dtlab.course.lab_claims, which the labs import.

- :func:`smoke_claim` (lab 0): a 1 MiB all-reduce takes longer than a 4 KiB one;
- :func:`exposed_claim` (lab 1): a step with all-reduces takes at least as long as with a no-op hook;
- :func:`backward_claim` (lab 7): backward costs about twice forward;
- :func:`fit_note` (labs 5 and 8): how rough a poor alpha-beta fit's predictions are.
"""

from __future__ import annotations

from dtlab.course.claims import Spread, compare, spread
from dtlab.units import fmt_ratio, fmt_time


def smoke_claim(t_ms: dict):
    """Lab 0: 'a 1 MiB all-reduce takes longer than a 4 KiB one' from the smoke test's timed calls (ms)."""
    small, big = min(t_ms), max(t_ms)
    a, b = [v / 1e3 for v in t_ms[big]], [v / 1e3 for v in t_ms[small]]

    def why(result):
        ratio = spread(a).median / spread(b).median
        if ratio > 1:
            head = (
                f"the larger calls took longer in the median ({fmt_ratio(ratio)}), but the {len(a)} calls per size "
                "scatter so much that the middle halves of the two sets overlap"
            )
        else:
            head = (
                f"the {small:,} B calls took longer in the median than the {big:,} B ones: with {len(a)} timed "
                "calls per size, a call's time here varies more with what the shared cores are doing (gloo's "
                "threads waking, the other rank getting a core) than with the extra bytes"
            )
        return head + ". Lab 2 separates the two terms with a fit over many sizes and more calls."

    return compare(
        "lab00.sizes",
        f"an all-reduce of {big:,} B takes longer than one of {small:,} B: it moves {big // small}x the bytes",
        "time per call (slowest rank)",
        (f"{big:,} B", a),
        (f"{small:,} B", b),
        expected=None,
        model="alpha + beta n: the latency term is the same, the bandwidth term grows with n",
        test="above",
        why=why,
        per="call",
        paired=False,
    )


def exposed_claim(run):
    """'Communication can only add time: T_step >= T_comp' on a run's pairs of a training step and the no-op-hook
    step right after it (slowest rank per step; dtlab.config.baseline), judged by the 90% interval the breakdown
    prints for exposed communication (dtlab.results.breakdown): the claim holds only when the whole interval lies
    above 0, and an interval that holds 0 is inconclusive, with the noise's size as the reason. Runs recorded
    before the pairing compare all measured steps with all baseline steps, unpaired."""
    from dtlab.results.breakdown import figures
    from dtlab.results.spread import LEVEL

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
    busy = f["verdict"]["line"]

    def why(result):
        noise = (e_hi - e_lo) / 2
        where = (
            f"over {f['n_diff']} pairs (a training step, then a no-op-hook step)"
            if paired
            else f"over {len(step)} training steps and {len(base)} baseline steps run after them (unpaired)"
        )
        if result == "inconclusive":
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


def backward_claim(run):
    """'Backward costs about twice forward' on the no-op baseline steps of a run (slowest rank per step)."""
    base = run.baseline_steps
    slow = base.loc[base.groupby("step")["t_step"].idxmax()]
    fwd, bwd = list(slow["t_fwd"]), list(slow["t_bwd"])

    def why(result):
        f, b = spread(fwd), spread(bwd)
        return (
            "the factor 2 counts arithmetic. Here forward also holds a collective: DDP broadcasts the model's "
            "buffers (DistilBERT's position_ids) from rank 0 at the start of every forward (broadcast_buffers, "
            "on by default), in the no-op-hook baseline too, so t_fwd includes waiting for the other node's rank. "
            f"And on shared cores the steps scatter: over {f.n} baseline steps forward took {fmt_time(f.lo)} .. "
            f"{fmt_time(f.hi)} and backward {fmt_time(b.lo)} .. {fmt_time(b.hi)}. The model below uses these "
            "medians as measured."
        )

    return compare(
        "lab07.backward",
        "backward costs about twice forward (it computes the gradients of both the weights and the activations)",
        "compute per step (no-op hook baseline)",
        ("backward", bwd),
        ("forward", fwd),
        expected=2.0,
        model="about 2x the forward pass's arithmetic (Kaplan et al. "
        "2020, 'Scaling Laws for Neural Language Models', section 2.1)",
        rel_tol=0.5,
        why=why,
        per="step",
        how="pairs of the same baseline step",
    )


def fit_note(fit, n_calls: int, limit: float = 0.2) -> str:
    """A sentence for a fit whose relative RMS error exceeds `limit` (0.2: 20%): how rough its predictions
    are and why; '' for a good fit."""
    if not fit.rel_rms > limit:
        return ""
    return (
        f"note: the fitted line misses the measured times by {fit.rel_rms:.0%} on average (relative RMS): the "
        f"{n_calls} timed calls scatter on shared cores. Read the model's times below as rough, about "
        f"±{fit.rel_rms:.0%}; lab 2 shows the samples and the fit."
    )
