"""The claims lab 6 prints (dtlab.course.claims): a straggler's delay is its peer's wait, and a parameter server is
slower than the ring all-reduce (against the interleaved runs of dtlab.course.claims.runs)."""

from __future__ import annotations

import pandas as pd

from dtlab.course.claims import compare, spread
from dtlab.units import fmt_ratio, fmt_time


def straggler_claim(waits: pd.DataFrame, waiter: int = 0, slow: int = 1):
    """'Rank `waiter` waits about rank `slow`'s injected delay each step' (the synchronous-step model with equal
    compute), paired step by step within one run (dtlab.results.stragglers.run_waits frame)."""
    w = waits.set_index(["step", "rank"])
    steps = sorted(set(waits["step"]))
    wait = [float(w.loc[(s, waiter), "wait_s"]) for s in steps]
    delay = [float(w.loc[(s, slow), "straggle_s"]) for s in steps]
    own = [
        float(w.loc[(s, slow), "t_comp_s"] - w.loc[(s, slow), "straggle_s"] - w.loc[(s, waiter), "t_comp_s"])
        for s in steps
    ]

    def why(outcome):
        d = spread(own)
        return (
            f"the synchronous-step model says rank {waiter} waits max_j T_comp,j - T_comp,{waiter}: rank {slow}'s "
            f"delay plus the difference of their own compute, which was {fmt_time(d.median)} per step here "
            f"(range {fmt_time(d.lo)} .. {fmt_time(d.hi)}): compute on shared cores varies by tens of percent "
            "from step to step."
        )

    return compare(
        "lab06.straggler_wait",
        f"rank {waiter} waits for rank {slow}'s injected delay every step",
        "time per step",
        (f"rank {waiter}'s wait", wait),
        (f"rank {slow}'s injected delay", delay),
        expected=1.0,
        model="synchronous steps with equal compute: wait = the delay",
        rel_tol=0.5,
        why=why,
        per="step",
        how=f"pairs of the same step of one run ({len(steps)} steps)",
    )


def ps_ring_claim(timed: dict, forms: pd.DataFrame, samples: pd.DataFrame, how: str, ring: str, ps: str):
    """'The parameter server is slower than the ring at p = 2' (T_comm of interleaved runs) against the
    forms' ratio, with the calibrated collectives alone as the evidence when it does not hold."""
    expect = float(forms.set_index("nproc").loc[2, "ps_over_ring_gloo"])
    med = samples[samples["nproc"] == 2].groupby(["op", "nbytes"])["seconds"].median()
    ratio = (med["ps"] / med["all_reduce"]).dropna()
    comm = {k: [r.per_step()["t_comm"].median() for r in timed[k]] for k in (ring, ps)}

    def why(outcome):
        alone = ", ".join(f"{fmt_ratio(r)} at {int(n):,} B" for n, r in ratio.items())
        rs, ps_ = spread(comm[ring]), spread(comm[ps])
        if outcome == "inconclusive":
            head = (
                f"the runs disagree with each other: {ring} T_comm {fmt_time(rs.lo)} .. {fmt_time(rs.hi)}, {ps} "
                f"{fmt_time(ps_.lo)} .. {fmt_time(ps_.hi)}. In training, T_comm is time in flight beside "
                "backward on the shared cores, waits for the other rank included, and it scatters more than "
                "the difference the forms predict."
            )
        else:
            head = (
                f"in every run the parameter server's T_comm was below the ring's ({fmt_time(ps_.median)} "
                f"against {fmt_time(rs.median)}). In training the buckets are all-reduced beside backward on "
                "the shared cores and wait for the other rank; which of these favoured the server here is not "
                "separated by this lab."
            )
        return head + f" The collectives alone at p = 2 (the calibration above) gave PS / ring = {alone}."

    return compare(
        "lab06.ps_vs_ring",
        "a parameter server is slower than the ring all-reduce",
        "T_comm per step",
        (ps, comm[ps]),
        (ring, comm[ring]),
        expected=expect,
        model="gloo's reduce + broadcast over its ring all-reduce at p = 2 (dtlab.model.ps), "
        "with this machine's all-reduce fit",
        test="above",
        why=why,
        how=how,
    )
