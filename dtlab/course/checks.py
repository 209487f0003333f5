"""Formative checks: a student's answer judged in the notebook, right after the measurement that answers it.

`check(qid, answer, **sources)` computes the question's key with the lab's own rubric (dtlab.course.rubric) from
the objects the notebook holds (a run, a profile, ...) and prints the verdict (dtlab.course.verdicts): correct /
within tolerance / missed with a hint / not answered yet. The autograder computes the same key with the same code
from the recorded run directories, in a process of its own (dtlab.course.grader): nothing a notebook does to this
module, its records or its outputs changes a grade. A verdict never shows the key (the expected value, the right
choice or the formula), not even before an answer; so the records hold none either.

Each check also records its verdict in the cell's output, a ``display_data`` whose MIME type
``application/vnd.dtlab.answer+json`` holds the record (``text/plain`` is the verdict, so a student sees only that);
outside IPython the verdict is printed followed by one line ``DTLAB-ANSWER {json}``. :func:`parse_answers` reads
them back: what the notebook showed, not a grade.

The explicit forms `check_number`, `check_choice`, `check_formula` and `check_exercise` take the key's parts as
arguments (labs call `check`; these stay for notebooks and exercises of one's own). A None answer never raises:
it is recorded as not answered with 0 points.
"""

from __future__ import annotations

import math

from dtlab.course import outputs, rubric
from dtlab.course.verdicts import Key, judge, judge_formula, unanswered

MIME = "application/vnd.dtlab.answer+json"
PREFIX = "DTLAB-ANSWER "


class Record(dict):
    """The recorded verdict (a dict, no key in it). Displays as nothing in IPython, so a check may end a cell."""

    def _ipython_display_(self):
        pass


def tol_from_spread(values, method: str = "range", floor: float = 0.0) -> float:
    """Relative tolerance from the spread of repeated measurements (per-step times, per-iteration samples,
    per-rank figures): the half-width of their spread divided by their median.

    method "range": (max - min) / 2 / median; "iqr": (q75 - q25) / 2 / median (linear interpolation between
    order statistics, as numpy's default). The result is at least `floor`. Non-finite values are dropped;
    fewer than two values, or a zero median, give `floor`. (Verdicts cap every tolerance at 50%.)"""
    xs = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if len(xs) < 2:
        return float(floor)
    med = _quantile(xs, 0.5)
    if med == 0:
        return float(floor)
    if method == "range":
        half = (xs[-1] - xs[0]) / 2
    elif method == "iqr":
        half = (_quantile(xs, 0.75) - _quantile(xs, 0.25)) / 2
    else:
        raise ValueError(f"method must be 'range' or 'iqr', got {method!r}")
    return max(float(floor), abs(half / med))


def _quantile(xs, q):
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


RECORDED: dict = {}  # qid -> the last Record checked in this process (formative; never read by the grader)


def _emit(rec: dict) -> Record:
    rec = Record(rec)
    RECORDED[rec["qid"]] = rec
    outputs.show(dict(rec), mime=MIME, prefix=PREFIX, text=rec["verdict"])
    return rec


def show(key: Key, answer) -> Record:
    """Judge `answer` against `key` and show the verdict (see dtlab.course.verdicts)."""
    return _emit(judge(key, answer))


def check(qid: str, answer, **sources) -> Record:
    """The formative check of a lab question: its key from `sources` (what the lab's rubric needs, e.g.
    `run=run` or `profile=profile`; dtlab.course.rubric names them per question), the verdict shown and recorded.
    Unknown qids and missing sources raise ValueError naming them. A source that is None (the run of an earlier
    section failed, dtlab.course.labs.attempt) is said in one line and nothing is checked or raised, so the rest
    of the lab still runs."""
    try:
        needs = next(q.needs for q in rubric.questions(rubric.lab_of(qid)) if q.qid == qid)
    except (ValueError, StopIteration):
        needs = ()  # an unknown qid: rubric.key names it below
    missing = [name for name in needs if name in sources and sources[name] is None]
    if missing:
        print(f"[{qid}] not checked: {', '.join(missing)} is missing (its run failed above; rerun that section)")
        return None
    return show(rubric.key(qid, **sources), answer)


def answered(what: str, *answers) -> bool:
    """True when every one of `answers` is given (not None, not otter's `...`). Otherwise prints that `what` (the
    bill, the table: whatever would answer the question) is shown once the answers are set, and returns False: a
    check cell run before an answer shows nothing that answers its question.

        if answered("the bill", my_gpu_hours_per_epoch, my_usd_per_epoch):
            print(bill)
    """
    if not any(unanswered(a) for a in answers):
        return True
    print(f"answer first: {what} is shown here once your answer{'s are' if len(answers) > 1 else ' is'} set above")
    return False


def check_number(
    qid: str,
    guess,
    expected,
    *,
    rel_tol: float | None = None,
    abs_tol: float | None = None,
    tol_source: str,
    unit: str = "",
    hint_on_miss: str = "",
    ratio_hints: dict | None = None,
    points: int = 1,
) -> Record:
    """`guess` against `expected` (both in `unit`): within abs_tol, or within rel_tol x |expected| (the larger of
    the two when both are given; at most 50% of |expected|). `tol_source` says where the tolerance comes from.
    `ratio_hints` {ratio: text}: when guess / expected is within 5% of a ratio, its text is the hint (e.g.
    {0.25: "you counted parameters, not 4-byte fp32 gradients"}), else `hint_on_miss`. The verdict never shows
    `expected`."""
    return show(
        Key(
            qid,
            "number",
            float(expected) if not isinstance(expected, int) else expected,
            points=points,
            rel_tol=rel_tol,
            abs_tol=abs_tol,
            tol_source=tol_source,
            unit=unit,
            hint=hint_on_miss,
            ratio_hints=dict(ratio_hints or {}),
        ),
        guess,
    )


def check_choice(
    qid: str,
    answer,
    correct,
    choices,
    explanation: str = "",
    points: int = 1,
    tol_source: str = "exact choice",
    hint: str = "",
) -> Record:
    """`answer` must be one of `choices`; `correct` is the right choice, or a list of choices that are all
    right (e.g. bucket sizes whose step times are equal within the measurement's spread). Strings compare
    case- and space-insensitively. `explanation` is shown once the answer is right, `hint` after a miss (neither
    may name the answer); `tol_source` says why several choices may be right."""
    return show(
        Key(
            qid,
            "choice",
            correct,
            points=points,
            choices=tuple(choices),
            tol_source=tol_source,
            explanation=explanation,
            hint=hint,
        ),
        answer,
    )


def check_formula(
    qid: str,
    answer: str | None,
    expected,
    *,
    variables=("p", "n"),
    grid: dict | None = None,
    expected_text: str = "",
    hint_on_miss: str = "",
    rel_tol: float = 1e-6,
    points: int = 1,
) -> Record:
    """`answer`, a formula string in `variables` (e.g. "2*(p-1)/p*n"), against `expected(**values)` (a
    function, e.g. from dtlab.model.costmodel) on every point of `grid` {name: values} (default p in
    2, 3, 4, 8, 64 and n in 1, 1000, 2**25): equal within rel_tol (float rounding) at every point.
    `expected_text` is shown once the answer is right (never before)."""
    key = Key(
        qid,
        "formula",
        expected,
        points=points,
        variables=tuple(variables),
        grid=grid,
        hint=hint_on_miss,
        explanation=expected_text,
        tol_source="exact formula, compared at every point of a grid",
    )
    return _emit(judge_formula(key, answer, rel_tol=rel_tol))


def check_exercise(qid: str, result, points: int = 1) -> Record:
    """A "build it yourself" check (a dtlab.course.exercises.ExerciseResult) as a graded answer: right when
    it passed; a stub counts as not answered; the feedback names what failed."""
    return show(Key(qid, "exercise", result, points=points, tol_source="the exercise's own checks"), None)


def graded(qid: str, env: dict | None = None) -> None:
    """The autograder's test of one question (`graded("lab01.q1", globals())` in a master's hidden test): the
    question is graded in a separate process (dtlab.course.autograde.graded) from the answer variables in `env`
    and the recorded run directories; raises AssertionError with the verdict when it is not right."""
    from dtlab.course.autograde import graded as apart  # the grader with it: loaded only when a hidden test runs

    apart(qid, env or {})


def parse_answers(notebook_path) -> list[dict]:
    """Every verdict recorded in an executed notebook's outputs, in cell order: the dtlab MIME type of
    display_data / execute_result outputs and `DTLAB-ANSWER {json}` lines of stream outputs (a line that does not
    parse as a JSON object with a qid is skipped; dtlab.course.outputs). When a check ran twice in a notebook, both
    records are returned (the last one counts). Formative: outputs are whatever the notebook file says, so a grade
    never comes from them (`dtlab grade` re-runs the notebook and computes every key itself)."""
    return outputs.read(notebook_path, mime=MIME, prefix=PREFIX, required="qid")


def score(answers: list[dict]) -> dict:
    """{qid: the last record of each qid}, and the totals: {"points", "max_points", "by_qid"}. Formative (what a
    notebook showed itself); grades come from `dtlab grade`."""
    last = {a["qid"]: a for a in answers}
    return {
        "points": sum(a.get("points", 0) for a in last.values()),
        "max_points": sum(a.get("max_points", 0) for a in last.values()),
        "by_qid": last,
    }
