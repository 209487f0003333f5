"""The claims lab 10 prints about tensor and pipeline parallelism, each from the runs on screen (dtlab.course.claims).

- `tp_count_claim(run)`: Megatron's 4 all-reduces per block per step, 2 forward and 2 backward (exact counts);
- `bubble_falls_claim(m1, m4)`: the bubble shrinks from M = 1 to M = 4, step by step;
- `bubble_theory_claim(run)`: the measured bubble against (P-1)/(M+P-1); where it does not hold, the reason from
  the same run: unequal stages (the theory for its own stages) and the time spent in transfers.
"""

from __future__ import annotations

from dtlab.course.claims import compare
from dtlab.results.parallel import tp_collectives
from dtlab.units import fmt_time


def tp_count_claim(run):
    """'A tensor-parallel step has 4 all-reduces per transformer block', from every rank-step of a 'tp' run."""
    t = tp_collectives(run).sort_values(["step", "rank"])
    L = int(run.resolved["n_layers"])

    def why(_):
        bad = t[~t["matches"]].iloc[0]
        return (
            f"rank {int(bad['rank'])} step {int(bad['step'])} recorded {int(bad['forward'])} all-reduces in forward "
            f"and {int(bad['backward'])} in backward of {int(bad['bytes_min']):,}..{int(bad['bytes_max']):,} B; "
            "a plan that gives q, k and v inputs of their own all-reduces their input gradients three times"
        )

    return compare(
        "lab10.tp_allreduces",
        "a tensor-parallel step has 4 all-reduces per transformer block, 2 in "
        "forward and 2 in backward (Megatron-LM, without sequence parallelism)",
        "all-reduces per rank and step",
        ("recorded", t["count"].tolist()),
        ("4 x layers", [4 * L] * len(t)),
        expected=1.0,
        unit="",
        rel_tol=0.0,
        per="rank-step",
        model=f"{L} blocks x 4",
        why=why,
        how="every rank-step, counted exactly",
    )


def bubble_falls_claim(m1, m4):
    """'More micro-batches shrink the bubble', step by step from two pipeline runs of the same stages."""
    a, b = m4.bubble(), m1.bubble()
    x4, x1 = a.steps.groupby("step")["bubble"].mean().tolist(), b.steps.groupby("step")["bubble"].mean().tolist()
    n = min(len(x4), len(x1))

    def why(_):
        return (
            f"the measured bubbles were {a.measured:.2f} at M = {a.microbatches} and {b.measured:.2f} at M = "
            f"{b.microbatches}: each micro-batch pays gloo's per-message cost for its sends and receives and the "
            f"schedule's own bookkeeping, which at M = {a.microbatches} is {a.microbatches}x as many hand-offs for "
            "the same compute"
        )

    return compare(
        "lab10.bubble_falls",
        f"splitting the batch into M = {a.microbatches} micro-batches instead of "
        f"{b.microbatches} shrinks the pipeline bubble",
        "bubble (fraction of the step)",
        (f"M={a.microbatches}", x4[:n]),
        (f"M={b.microbatches}", x1[:n]),
        expected=a.theory / b.theory,
        model=f"(P-1)/(M+P-1): {a.theory:.3f} against {b.theory:.3f}",
        unit="",
        test="below",
        per="step",
        why=why,
        how="measured steps paired by index",
    )


def bubble_theory_claim(run, rel_tol: float = 0.25):
    """'The bubble is (P-1)/(M+P-1)', against one pipeline run's steps."""
    b = run.bubble()
    per = b.steps.groupby("step")[["bubble", "unequal"]].mean()

    def why(_):
        busy = {
            int(k.removeprefix("busy_s")): float(b.steps[k].median()) for k in b.steps.columns if k.startswith("busy_s")
        }
        t = float(b.steps["t_pipe"].median())
        rest = (b.measured - b.unequal) * t
        hand = 2 * b.microbatches
        text = (
            "the theory assumes equal stages and free transfers. Here the stages computed "
            + ", ".join(f"{fmt_time(v)} (stage {s})" for s, v in sorted(busy.items()))
            + f" per step: with these stages the same schedule would idle {b.unequal:.2f} of the step (the "
            "slowest stage sets the pace, the others wait for it)"
        )
        if rest > 0:
            text += (
                f"; the rest, {b.measured - b.unequal:.2f} of a {fmt_time(t)} step ({fmt_time(rest)}), is what "
                f"the {hand} hand-offs of each stage cost beyond compute, about {fmt_time(rest / hand)} each "
                "(gloo's send and receive and the waits around them)"
            )
        return text + "."

    return compare(
        "lab10.bubble_theory",
        f"with P = {b.stages} stages and M = {b.microbatches} micro-batches each stage idles (P-1)/(M+P-1) of a step",
        "bubble (fraction of the step)",
        (f"measured M={b.microbatches}", per["bubble"].tolist()),
        ("theory", [b.theory] * len(per)),
        expected=1.0,
        unit="",
        rel_tol=rel_tol,
        per="step",
        model=f"(P-1)/(M+P-1) = {b.theory:.3f}, {b.schedule}",
        why=why,
        how=f"{b.schedule}, measured steps",
    )
