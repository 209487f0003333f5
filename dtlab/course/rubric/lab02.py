"""Lab 2 (collectives and alpha-beta): the largest all-reduce, the ring fit's prediction at p = 8, the 25 MiB
regime, the ring's bandwidth term over the textbook's as a formula, gloo's reduce-scatter against an all-reduce."""

from __future__ import annotations

import math

from dtlab.course.checks import tol_from_spread
from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key
from dtlab.model import costmodel
from dtlab.model.costmodel import coefficients

LAB = "02_collectives_alpha_beta"
P_PREDICT = 8  # lab02.q2 asks for the ring fit's prediction on this many ranks
MIB25 = 25 * 2**20


def sizes(quick: bool) -> list[int]:
    """The lab's SIZES: 4 KiB .. 4 MiB (quick) or 64 MiB."""
    return [2**k for k in range(12, 23 if quick else 27)]


def sources(rec) -> dict:
    """The lab's sweep: all-reduce, reduce-scatter and all-gather on 2 ranks over SIZES."""
    fields = {"nproc": 2, "ops": ["all_reduce", "reduce_scatter", "all_gather"], "sizes": sizes(rec.quick)}
    return {"profile": lambda: rec.calibration(fields, "lab 2's calibration sweep (3 ops on 2 ranks over SIZES)")}


def _sizes_of(profile) -> list[int]:
    return sorted(int(n) for n in profile.samples["nbytes"].unique())


def _largest_ms(profile, op="all_reduce"):
    s = profile.samples
    n = _sizes_of(profile)[-1]
    return s[(s["op"] == op) & (s["nbytes"] == n)]["seconds"] * 1e3, n


def _guess(profile) -> Key:
    largest, n = _largest_ms(profile)
    ar = profile.fits["all_reduce"]
    return Key(
        "lab02.q1",
        "number",
        float(largest.median()),
        points=2,
        rel_tol=tol_from_spread(largest, floor=0.1),
        unit="ms",
        tol_source=f"the spread of the {len(largest)} timed iterations at {n:,} B (half the min..max "
        "range over the median, at least 10%)",
        hint=f"n = {n:,} B at the fitted bandwidth 1/beta = {1 / ar.beta / 1e9:.2f} GB/s, plus the latency "
        "terms (2 alpha at p = 2)",
    )


def held_out(profile) -> int:
    """The lab's held-out size, 3 x SIZES[-3]: between two measured powers of two."""
    return 3 * _sizes_of(profile)[-3]


def _predict8(profile) -> Key:
    ar = profile.fits["all_reduce"]
    n = held_out(profile)
    want = float(costmodel.ring_allreduce(ar.alpha, ar.beta, n, P_PREDICT)) * 1e3
    at2 = float(costmodel.ring_allreduce(ar.alpha, ar.beta, n, 2)) * 1e3
    textbook = float(costmodel.collective_time("all_reduce", "textbook", ar.alpha, ar.beta, n, P_PREDICT)) * 1e3
    return Key(
        "lab02.q2",
        "number",
        want,
        rel_tol=0.05,
        unit="ms",
        tol_source="the ring fit's own prediction (alpha and beta of profile.fits['all_reduce']); 5% allows "
        "alpha and beta rounded as printed",
        ratio_hints={
            at2 / want: "that is the prediction for p = 2; the question asks for p = 8 ranks",
            textbook / want: "that is the textbook form alpha (p-1) + beta n / p; use the ring form "
            "the fit was made in",
        },
        hint="use the ring form with the fitted alpha and beta (printed at the top of this lab), at p = 8: "
        "count its latency steps and the bytes each rank moves",
    )


def _regime(profile) -> Key:
    s = _sizes_of(profile)
    regime = "inside the measured sizes" if s[0] <= MIB25 <= s[-1] else "extrapolated"
    return Key(
        "lab02.q3",
        "choice",
        regime,
        choices=("inside the measured sizes", "extrapolated"),
        explanation=f"SIZES spans {s[0]:,} .. {s[-1]:,} B and 25 MiB is {MIB25:,} B",
        hint="compare 25 MiB, in bytes, with the first and last of SIZES",
    )


def ring_over_textbook(p, n):
    """The ring all-reduce's bandwidth term over the textbook's (dtlab.model.costmodel's coefficients B x n)."""
    return coefficients("all_reduce", "ring", p)[1] * n / (coefficients("all_reduce", "textbook", p)[1] * n)


def _formula(*_) -> Key:
    return Key(
        "lab02.q4",
        "formula",
        ring_over_textbook,
        points=2,
        explanation="2 (p-1)/p n over n/p = 2(p-1): 2 at p = 2, where the fitted betas absorb it (they differ "
        "by exactly 2), 14 at p = 8, where the two forms' predictions part",
        tol_source="exact formula, compared at every point of a grid",
        hint="divide the ring's beta term by the textbook's, both from the table at the top of the lab; "
        "beta and n cancel",
    )


def _rs_vs_ar(profile) -> Key:
    ar, n = _largest_ms(profile)
    rs, _ = _largest_ms(profile, "reduce_scatter")
    ratio = float(rs.median() / ar.median())
    shapes = {"about half an all-reduce": 0.5, "about a whole all-reduce": 1.0}
    return Key(
        "lab02.q5",
        "choice",
        min(shapes, key=lambda k: abs(math.log(ratio / shapes[k]))),
        choices=tuple(shapes),
        explanation=f"measured reduce-scatter / all-reduce at {n:,} B: {ratio:.2f} (gloo's reduce-scatter is an "
        "all-reduce plus a chunk; a real one moves half the bytes)",
        hint="divide the two measured medians at the largest size (printed above) and compare on a log scale",
    )


QUESTIONS = (
    Question("lab02.q1", 2, "my_guess_ms", ("profile",), _guess),
    Question("lab02.q2", 1, "my_held_out_ms", ("profile",), _predict8),
    Question("lab02.q3", 1, "my_25mib_regime", ("profile",), _regime),
    Question("lab02.q4", 2, "my_ring_over_textbook", (), _formula),
    Question("lab02.q5", 1, "my_rs_vs_ar", ("profile",), _rs_vs_ar),
)
