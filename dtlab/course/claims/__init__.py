"""Statements about outcomes, computed from the runs on screen: what the model says beside what was measured.

A lab never prints "accumulation cuts T_comm per sample by K" as a fact: it measures both configurations,
several times and interleaved (dtlab.course.claims.runs), and prints a :class:`Claim`: the textbook statement, the
model's value, the measured value with how many runs and their spread, and an outcome computed from those numbers:

- ``holds``: the measured median agrees with the model (``test="within"``: within `rel_tol` of the model's
  ratio; ``"below"`` / ``"above"``: every run's ratio lies on the model's side of 1);
- ``contradicted``: every run disagrees (the whole range lies outside the band, or on the other side of 1);
- ``inconclusive``: the runs disagree with each other (the range straddles the band or 1).

Anything but ``holds`` must carry a `why` from the lab: the reason this machine differs (contention, fp16 on a
CPU, cold start, oversubscription), with the measurement that shows it where there is one. The record goes
into the cell's output under :data:`MIME` (``text/plain`` and ``text/html`` are what a student reads), so a test
can check every printed claim against its own numbers (:func:`parse_claims`, :func:`consistent`).

This package holds the machinery; each lab's claims are one module of it, which the lab imports as
``from dtlab.lab import lab05_claims as lab_claims`` (`lab00`, `lab01`, `lab03`, `lab05` to `lab10`), and the
runs they share (interleaved repeats, their medians) are in dtlab.course.claims.runs. Pure apart from
:meth:`Claim.show` (which displays).
"""

from __future__ import annotations

import html
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from dtlab.course import outputs
from dtlab.units import fmt_bytes_exact, fmt_ratio, fmt_time

MIME = "application/vnd.dtlab.claim+json"
PREFIX = "DTLAB-CLAIM "
TESTS = ("within", "below", "above")
OUTCOMES = ("holds", "inconclusive", "contradicted")


@dataclass(frozen=True)
class Spread:
    """Median, smallest and largest of `n` values (one per run)."""

    median: float
    lo: float
    hi: float
    n: int


def spread(values) -> Spread:
    """The :class:`Spread` of finite values; ValueError naming what was given when there is none."""
    vals = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if not vals:
        raise ValueError(f"values must hold at least one finite number, got {list(values)!r}")
    k = len(vals)
    med = vals[k // 2] if k % 2 else (vals[k // 2 - 1] + vals[k // 2]) / 2
    return Spread(med, vals[0], vals[-1], k)


#: Repeats a claim about time needs before it may hold or be contradicted: fewer are inconclusive, spread shown.
MIN_TIME_REPEATS = 3


def outcome_of(ratios: Spread, expected: float, test: str, rel_tol: float, min_n: int = 1) -> str:
    """'holds', 'inconclusive' or 'contradicted' for measured ratios against the model's ratio `expected`
    (see the module's docstring); 'inconclusive' whatever they say when there are fewer than `min_n` of them."""
    if test not in TESTS:
        raise ValueError(f"test must be one of {TESTS}, got {test!r}")
    if ratios.n < min_n:
        return "inconclusive"
    if test == "within":
        if not (rel_tol >= 0 and expected is not None and expected > 0):
            raise ValueError(f"a 'within' claim needs expected > 0 and rel_tol >= 0, got {expected!r}, {rel_tol!r}")
        lo_band, hi_band = expected * (1 - rel_tol), expected * (1 + rel_tol)
        if lo_band <= ratios.median <= hi_band:
            return "holds"
        return "contradicted" if ratios.hi < lo_band or ratios.lo > hi_band else "inconclusive"
    below = test == "below"
    if (ratios.hi < 1) if below else (ratios.lo > 1):
        return "holds"
    if (ratios.lo > 1) if below else (ratios.hi < 1):
        return "contradicted"
    return "inconclusive"


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return fmt_time(value)
    if unit == "B":
        return fmt_bytes_exact(value) if float(value).is_integer() else f"{value:,.1f} B"
    return f"{value:.3g}" + (f" {unit}" if unit else "")


@dataclass
class Claim:
    """A statement about an outcome and the measurement that tests it (build it with :func:`compare`).

    cid: an id unique in its lab ('lab05.accumulate'); says: the statement as the textbook (or the lab's own
    text) makes it; quantity: what is compared; a, b: the two configurations' labels; values: label ->
    :class:`Spread` of the quantity per run, in `unit` ('s', 'B' or a unit name); ratios: the :class:`Spread`
    of a / b over paired runs; expected: the model's a / b; model: where `expected` comes from; test and
    rel_tol: how the outcome is reached (:func:`outcome_of`); why: the reason when it does not hold; how: how the
    runs were made (count and order); per: what one value is ('run', 'step', 'size', 'call'); paired: whether
    value i of a and of b were measured together (then `ratios` spans the ratios of pairs; otherwise it spans
    Q1(a) / Q3(b) .. Q3(a) / Q1(b) around the ratio of the medians, the middle halves of both sets). expected
    may be None for a "below" / "above" claim (the model says only which side of 1)."""

    cid: str
    says: str
    quantity: str
    a: str
    b: str
    values: dict
    unit: str
    ratios: Spread
    expected: float | None
    model: str
    test: str = "within"
    rel_tol: float = 0.25
    why: str | None = None
    how: str = ""
    per: str = "run"
    paired: bool = True
    interval: str = ""
    """What `ratios`' lo .. hi are when not the measured range ('' for the range, or the quartiles when unpaired):
    e.g. a bootstrap interval of the median (dtlab.results.spread)."""
    min_n: int = 1
    """Ratios needed before the claim may hold or be contradicted (a claim about time: MIN_TIME_REPEATS)."""
    outcome: str = field(init=False)
    """One of OUTCOMES, from the numbers above (:func:`outcome_of`)."""

    def __post_init__(self):
        self.outcome = outcome_of(self.ratios, self.expected, self.test, self.rel_tol, self.min_n)
        if self.outcome != "holds" and not self.why:
            raise ValueError(
                f"claim {self.cid!r} is {self.outcome} on this machine: give `why` (what makes this "
                f"machine differ, with the measurement that shows it)"
            )

    @property
    def holds(self) -> bool:
        return self.outcome == "holds"

    def lines(self) -> list:
        """The claim as a person reads it: statement and model, measurement, outcome (and why)."""
        va, vb = self.values[self.a], self.values[self.b]
        r = self.ratios
        rng = f"range {fmt_ratio(r.lo)} .. {fmt_ratio(r.hi)}" if r.n > 1 else f"a single {self.per}: no spread"
        if self.interval:
            rng = f"{self.interval} {fmt_ratio(r.lo)} .. {fmt_ratio(r.hi)}"
        elif not self.paired and r.n > 1:
            rng += f": quartiles of {va.n} x {vb.n} unpaired {self.per}s"
        band = {
            "within": f"within ±{self.rel_tol:.0%} of the model",
            "below": "below ×1 in every run",
            "above": "above ×1 in every run",
        }[self.test]
        if self.interval and self.test != "within":
            band = f"{self.test} ×1 over the whole {self.interval}"
        if self.min_n > 1:
            band += f", from at least {self.min_n} {self.per}s"
        model = (
            f"{self.a} / {self.b} = {fmt_ratio(self.expected)}"
            if self.expected is not None
            else f"{self.a} / {self.b} {'below' if self.test == 'below' else 'above'} ×1"
        )
        out = [
            f"Claim ({self.cid}): {self.says}. Model: {model} ({self.model}).",
            f"Measured {self.quantity}: {self.a} {_fmt(va.median, self.unit)}, {self.b} {_fmt(vb.median, self.unit)}"
            f" (medians of {va.n} {self.per}(s) each{', ' + self.how if self.how else ''}); {self.a} / {self.b} = "
            f"{fmt_ratio(r.median)} ({rng}).",
            f"Outcome: {self.outcome.upper()} on this machine (the test: {band}).",
        ]
        if self.why:
            out.append(f"Why: {self.why}")
        return out

    def text(self) -> str:
        return "\n".join(self.lines())

    def record(self) -> dict:
        """The JSON record stored with the output (everything a test needs to re-derive the outcome)."""
        rec = asdict(self)
        rec["values"] = {k: asdict(v) for k, v in self.values.items()}
        return rec

    def html(self) -> str:
        """The claim as the notebook shows it: its lines, the outcome in its colour."""
        color = {"holds": "#1a7f37", "inconclusive": "#8a6d00", "contradicted": "#b3261e"}[self.outcome]
        body = "<br>".join(html.escape(line) for line in self.lines())
        body = body.replace(
            html.escape(f"Outcome: {self.outcome.upper()}"),
            f"<b style='color:{color}'>Outcome: {self.outcome.upper()}</b>",
        )
        return f"<div style='border-left:4px solid {color};padding-left:8px'>{body}</div>"

    def show(self) -> Claim:
        """Display the claim in the notebook (text, HTML and the record), or print it outside IPython."""
        outputs.show(self.record(), mime=MIME, prefix=PREFIX, text=self.text(), html=self.html())
        return self

    def _ipython_display_(self):
        self.show()


def compare(
    cid: str,
    says: str,
    quantity: str,
    a: tuple,
    b: tuple,
    *,
    expected: float | None,
    model: str,
    unit: str = "s",
    test: str = "within",
    rel_tol: float = 0.25,
    why=None,
    how: str = "",
    per: str = "run",
    paired: bool = True,
    ratios: Spread | None = None,
    interval: str = "",
    min_n: int | None = None,
) -> Claim:
    """A :class:`Claim` that `a` relates to `b` as the model says. a, b: (label, values), one value per run
    (paired by position: run i of a was made next to run i of b; `per`="step" for the steps of two runs), in
    `unit`. why: a sentence, or a function of the outcome ('inconclusive' / 'contradicted') returning one,
    used only when the claim does not hold. ratios: the a / b spread to judge by, when the lab computed it (a
    bootstrap interval of the median, named by `interval`) instead of the range of the values. min_n: ratios
    needed before an outcome other than 'inconclusive' (default: MIN_TIME_REPEATS for a claim about time, unit
    's'; 1 otherwise); with fewer, `why` is told so and the spread is shown."""
    (la, xa), (lb, xb) = a, b
    xa, xb = [float(v) for v in xa], [float(v) for v in xb]
    if not xa or not xb or (paired and len(xa) != len(xb)):
        raise ValueError(f"a and b need values{' in pairs' if paired else ''}, got {len(xa)} and {len(xb)}")
    if ratios is not None:
        pass
    elif paired:
        ratios = spread([p / q for p, q in zip(xa, xb) if q])
    else:  # the middle half of each set: one stray call does not decide
        (a1, am, a3), (b1, bm, b3) = _quartiles(xa), _quartiles(xb)
        ratios = Spread(am / bm, a1 / b3, a3 / b1, min(len(xa), len(xb)))
    if min_n is None:
        min_n = MIN_TIME_REPEATS if unit == "s" else 1
    decided = outcome_of(ratios, expected, test, rel_tol)  # what the numbers alone say, however few
    reason = (why(decided) if callable(why) else why) if decided != "holds" else None
    if ratios.n < min_n:
        reason = (
            f"{ratios.n} {per}(s) only: a claim about time needs at least {min_n} interleaved repeats "
            f"before it is decided (these alone would say {decided}; the spread above is all there is)."
            + (f" What to look at: {reason}" if reason else "")
        ).strip()
    return Claim(
        cid,
        says,
        quantity,
        la,
        lb,
        {la: spread(xa), lb: spread(xb)},
        unit,
        ratios,
        expected,
        model,
        test,
        rel_tol,
        reason,
        how,
        per,
        paired,
        interval,
        min_n,
    )


def _quartiles(values) -> tuple:
    """(first quartile, median, third quartile) of finite values (linear interpolation)."""
    return tuple(float(q) for q in np.percentile(sorted(values), [25, 50, 75]))


def consistent(record: dict) -> list:
    """What is wrong with a claim record read back from a notebook (empty when nothing): its outcome must
    follow from its own numbers, a claim that does not hold must say why, its median ratio must lie in its
    range, and there are as many ratios as paired runs."""
    problems = []
    r = Spread(**record["ratios"])
    want = outcome_of(r, record["expected"], record["test"], record["rel_tol"], int(record.get("min_n", 1)))
    if record["outcome"] != want:
        problems.append(f"{record['cid']}: prints {record['outcome']!r}, its numbers give {want!r}")
    if record["outcome"] != "holds" and not record.get("why"):
        problems.append(f"{record['cid']}: {record['outcome']} without a reason")
    if not r.lo <= r.median <= r.hi:
        problems.append(f"{record['cid']}: median ratio {r.median} outside its range {r.lo}..{r.hi}")
    va, vb = (Spread(**record["values"][k]) for k in (record["a"], record["b"]))
    if record.get("paired", True) and (va.n != vb.n or r.n > va.n):
        problems.append(f"{record['cid']}: {va.n} and {vb.n} runs, {r.n} ratios")
    return problems


def parse_claims(notebook_path) -> list:
    """Every claim record in an executed notebook's outputs, in cell order (the MIME output, or the
    ``DTLAB-CLAIM {json}`` line printed outside IPython; dtlab.course.outputs)."""
    return outputs.read(notebook_path, mime=MIME, prefix=PREFIX, required="cid")


def fit_note(fit, n_calls: int, limit: float = 0.2) -> str:
    """A sentence for a fit whose relative RMS error exceeds `limit` (0.2: 20%): how rough its predictions
    are and why; '' for a good fit (labs 5, 8 and 10 print it before a claim that uses the fit)."""
    if not fit.rel_rms > limit:
        return ""
    return (
        f"note: the fitted line misses the measured times by {fit.rel_rms:.0%} on average (relative RMS): the "
        f"{n_calls} timed calls scatter on shared cores. Read the model's times below as rough, about "
        f"±{fit.rel_rms:.0%}; lab 2 shows the samples and the fit."
    )
