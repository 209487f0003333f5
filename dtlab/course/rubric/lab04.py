"""Lab 4 (ZeRO-3 vs DDP): parameter and optimizer bytes per rank as fractions of DDP's, all-gathered bytes per
steady step, whether backward re-gathered."""

from __future__ import annotations

from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key

LAB = "04_zero3_vs_ddp"


def sources(rec) -> dict:
    """The ZeRO-3 run and the DDP run with the same ranks."""

    def z3():
        return rec.run(rec.lab_config(strategy="zero3", baseline_steps=0), "lab 4's ZeRO-3 run")

    def ddp():
        return rec.run(
            rec.lab_config(nproc=rec.lab_config(strategy="zero3", baseline_steps=0).nproc),
            "lab 4's DDP run (the ZeRO-3 run's ranks)",
        )

    return {"ddp": ddp, "z3": z3}


def _fraction(ddp, z3, col):
    f = z3.memory.set_index("rank")[col] / ddp.memory[col].median()
    return float(f.median()), max(0.02, float(f.max() - f.min()) / 2)


def _params(ddp, z3) -> Key:
    frac, tol = _fraction(ddp, z3, "params_bytes")
    return Key(
        "lab04.q1",
        "number",
        frac,
        points=2,
        abs_tol=tol,
        tol_source="the spread of the fraction across ranks (half its range, at least 0.02)",
        hint=f"ZeRO-3 keeps a 1/p = {1 / z3.nproc:.3f} shard of each parameter, but parameters under the "
        f"persistence threshold ({z3.resolved.get('persistent_bytes', 0):,} B here) stay whole on every "
        "rank, and shards are padded",
    )


def _optim(ddp, z3) -> Key:
    frac, tol = _fraction(ddp, z3, "opt_bytes")
    return Key(
        "lab04.q2",
        "number",
        frac,
        abs_tol=tol,
        tol_source="the spread of the fraction across ranks (half its range, at least 0.02)",
        hint="DDP holds AdamW's two moments (2P); ZeRO-3 holds them for its shard plus DeepSpeed's fp32 master "
        "copy of the shard",
    )


def _steady_gathers(z3):
    c = z3.collectives
    steady = c[c["step"] == c["step"].max()]
    return steady[(steady["op"] == "all_gather") & (steady["rank"] == 0)]


def _gathered(ddp, z3) -> Key:
    ag = _steady_gathers(z3)
    got = int(ag["nbytes"].sum())
    regathers = bool(ag.loc[ag["phase"] == "backward", "nbytes"].sum() > 0)
    p_bytes = int(z3.resolved["grad_bytes"])
    model = p_bytes * (2 if regathers else 1)
    return Key(
        "lab04.q3",
        "number",
        got,
        points=2,
        abs_tol=max(abs(got - model), 0.01 * got),
        unit="B",
        tol_source="the error of 'P per gather' on this run (P the model's gradient bytes, gathered "
        f"{'twice' if regathers else 'once'}: padding and persistent parameters), at least 1%",
        hint="all-gather's nbytes is the gathered output (whole parameters), not one rank's shard",
        show_tol=False,
        ratio_hints={
            2.0: "backward gathered nothing: parameters gathered in forward were kept "
            "(stage3_max_reuse_distance), so P moves once",
            1 / z3.nproc: "that is one rank's shard; all-gather's nbytes counts the gathered output",
        },
    )


def _backward(ddp, z3) -> Key:
    ag = _steady_gathers(z3)
    back = int(ag.loc[ag["phase"] == "backward", "nbytes"].sum())
    return Key(
        "lab04.q4",
        "choice",
        "yes" if back > 0 else "no",
        choices=("yes", "no"),
        explanation=f"backward all-gathered {back:,} B in the steady step; "
        f"{z3.resolved.get('allgather_backward_rule', '')}",
        hint="read the backward rows of the steady step's table above (phase backward, op all_gather)",
    )


QUESTIONS = (
    Question("lab04.q1", 2, "my_param_fraction", ("ddp", "z3"), _params),
    Question("lab04.q2", 1, "my_optim_fraction", ("ddp", "z3"), _optim),
    Question("lab04.q3", 2, "my_allgather_bytes", ("ddp", "z3"), _gathered),
    Question("lab04.q4", 1, "my_backward_gathered", ("ddp", "z3"), _backward),
)
