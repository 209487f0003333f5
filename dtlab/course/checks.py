"""Checked predictions: a student's answer against the value the notebook just measured or derived.

Every check prints a short verdict (correct / within tolerance / missed / not answered yet, the expected value
with its unit, the tolerance and where it comes from, and a hint on a miss) and records one machine-readable
answer in the cell's output: a ``display_data`` output whose MIME type ``application/vnd.dtlab.answer+json``
holds the record (``text/plain`` is the verdict, so a student sees only that). Outside IPython the verdict is
printed followed by one line ``DTLAB-ANSWER {json}``. :func:`parse_answers` reads both back from an .ipynb.

A record: ``{"qid", "kind" (number | choice | formula), "answer", "expected", "ok" (True, False, or None when not
answered), "points", "max_points", "tolerance", "tol_source", "unit"}``. A None answer never raises: it is
recorded as not answered with 0 points. Expected values are arguments: the labs pass what the run, profile or
config gave, never a figure typed into the check.
"""

from __future__ import annotations

import ast
import json
import math
import operator

MIME = "application/vnd.dtlab.answer+json"
PREFIX = "DTLAB-ANSWER "


class Record(dict):
    """The recorded answer (a dict). Displays as nothing in IPython, so a check may end a cell."""

    def _ipython_display_(self):
        pass


def tol_from_spread(values, method: str = "range", floor: float = 0.0) -> float:
    """Relative tolerance from the spread of repeated measurements (per-step times, per-iteration samples,
    per-rank figures): the half-width of their spread divided by their median.

    method "range": (max - min) / 2 / median; "iqr": (q75 - q25) / 2 / median (linear interpolation between
    order statistics, as numpy's default). The result is at least `floor`. Non-finite values are dropped;
    fewer than two values, or a zero median, give `floor`."""
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


def _fmt(x, unit=""):
    if isinstance(x, float):
        s = f"{x:,.0f}" if abs(x) >= 1e4 else f"{x:.4g}"
    elif isinstance(x, int):
        s = f"{x:,}"
    else:
        s = str(x)
    return f"{s} {unit}".rstrip()


def _num(x):
    """A JSON-friendly Python number (numpy scalars included)."""
    f = float(x)
    return int(f) if f == int(f) and abs(f) < 2 ** 53 and not isinstance(x, float) else f


RECORDED: dict = {}  # qid -> the last Record checked in this process
ANSWERS_VAR = "_dtlab_answers"  # the same records in a notebook's namespace, for the graders' tests


def _emit(rec: dict, verdict: str) -> Record:
    rec = Record(rec, verdict=verdict)
    RECORDED[rec["qid"]] = rec
    try:
        from IPython import get_ipython
        from IPython.display import display
        if get_ipython() is None:
            raise ImportError
    except ImportError:
        print(verdict)
        print(PREFIX + json.dumps(dict(rec)))
        return rec
    # also in the notebook's namespace: otter grades against the executed notebook's global variables
    get_ipython().user_ns.setdefault(ANSWERS_VAR, {})[rec["qid"]] = dict(rec)
    display({MIME: dict(rec), "text/plain": verdict}, raw=True)
    return rec


def _record(qid, kind, answer, expected, ok, points, **extra):
    return {"qid": qid, "kind": kind, "answer": answer, "expected": expected, "ok": ok,
            "points": points if ok else 0, "max_points": points, **extra}


def check_number(qid: str, guess, expected, *, rel_tol: float | None = None, abs_tol: float | None = None,
                 tol_source: str, unit: str = "", hint_on_miss: str = "", ratio_hints: dict | None = None,
                 points: int = 1) -> Record:
    """`guess` against `expected` (both in `unit`): within abs_tol, or within rel_tol x |expected|
    (the larger of the two when both are given). `tol_source` says where the tolerance comes from.
    `ratio_hints` {ratio: text}: when guess / expected is within 5% of a ratio, its text is the hint (e.g.
    {0.25: "you counted parameters, not 4-byte fp32 gradients"}), else `hint_on_miss`."""
    expected = _num(expected)
    tol = max(abs_tol or 0.0, (rel_tol or 0.0) * abs(float(expected)))
    tol_txt = f"± {_fmt(float(tol), unit)}" + (f" ({rel_tol:.1%})" if rel_tol else "") + f", from {tol_source}"
    extra = dict(tolerance=float(tol), rel_tol=rel_tol, abs_tol=abs_tol, tol_source=tol_source, unit=unit)
    if guess is None or guess is ...:  # None, or otter's blank `...`
        verdict = (f"[{qid}] not answered yet: set your guess and run the check again (expected "
                   f"{_fmt(expected, unit)} {tol_txt})")
        return _emit(_record(qid, "number", None, expected, None, points, **extra), verdict)
    try:
        g = float(guess)
    except (TypeError, ValueError):
        g = float("nan")
    diff = abs(g - float(expected))
    ok = bool(diff <= tol)
    if ok:
        word = "correct" if diff <= 1e-9 * max(1.0, abs(float(expected))) else "within tolerance"
        verdict = (f"[{qid}] {word}: you said {_fmt(guess, unit)}, expected {_fmt(expected, unit)} "
                   f"{tol_txt}")
    else:
        hint = hint_on_miss
        if ratio_hints and float(expected) != 0 and math.isfinite(g):
            r = g / float(expected)
            for k, text in ratio_hints.items():
                if abs(r / k - 1) <= 0.05:
                    hint = text
                    break
        ratio = f" ({g / float(expected):.3g} x expected)" if float(expected) != 0 and math.isfinite(g) else ""
        verdict = (f"[{qid}] missed: you said {_fmt(guess, unit)}{ratio}, expected {_fmt(expected, unit)} "
                   f"{tol_txt}" + (f"\n  hint: {hint}" if hint else ""))
    ans = _num(guess) if math.isfinite(g) else str(guess)
    return _emit(_record(qid, "number", ans, expected, ok, points, **extra), verdict)


def check_choice(qid: str, answer, correct, choices, explanation: str = "", points: int = 1,
                 tol_source: str = "exact choice") -> Record:
    """`answer` must be one of `choices`; `correct` is the right choice, or a list of choices that are all
    right (e.g. bucket sizes whose step times are equal within the measurement's spread). Strings compare
    case- and space-insensitively. `explanation` is shown with the verdict; `tol_source` says why several
    choices may be right."""
    choices = list(choices)
    right = list(correct) if isinstance(correct, (list, tuple, set)) else [correct]

    def norm(x):
        return " ".join(str(x).lower().split()) if isinstance(x, str) else x

    right_txt = " or ".join(repr(c) for c in right)
    extra = dict(choices=choices, tol_source=tol_source, unit="")
    if answer is None or answer is ...:  # None, or otter's blank `...`
        verdict = f"[{qid}] not answered yet: pick one of {choices}"
        return _emit(_record(qid, "choice", None, right if len(right) > 1 else right[0], None, points, **extra),
                     verdict)
    known = [c for c in choices if norm(c) == norm(answer)]
    ok = bool(known) and any(norm(c) == norm(answer) for c in right)
    if not known:
        verdict = f"[{qid}] missed: {answer!r} is not one of {choices}; the answer is {right_txt}"
    elif ok:
        verdict = f"[{qid}] correct: {answer!r}"
    else:
        verdict = f"[{qid}] missed: you chose {answer!r}, the answer is {right_txt}"
    if explanation:
        verdict += f"\n  {'why' if ok else 'hint'}: {explanation}"
    ans = answer if isinstance(answer, (str, int, float, bool)) else str(answer)
    return _emit(_record(qid, "choice", ans, right if len(right) > 1 else right[0], ok, points, **extra),
                 verdict)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def eval_expr(expr: str, env: dict) -> float:
    """Evaluate an arithmetic formula (numbers, the names in `env`, + - * / ** and parentheses; `^` is read
    as a power). Anything else raises ValueError: no calls, no attributes."""
    tree = ast.parse(expr.replace("^", "**"), mode="eval")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name) and node.id in env:
            return float(env[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not allowed in a formula: {ast.unparse(node)!r} (use {sorted(env)}, numbers, "
                         "+ - * / ** and parentheses)")
    return ev(tree)


def check_formula(qid: str, answer: str | None, expected, *, variables=("p", "n"), grid: dict | None = None,
                  expected_text: str = "", hint_on_miss: str = "", rel_tol: float = 1e-6,
                  points: int = 1) -> Record:
    """`answer`, a formula string in `variables` (e.g. "2*(p-1)/p*n"), against `expected(**values)` (a
    function, e.g. from dtlab.model.costmodel) on every point of `grid` {name: values} (default p in
    2, 3, 4, 8, 64 and n in 1, 1000, 2**25): equal within rel_tol (float rounding) at every point.
    `expected_text` is how the verdict writes the right formula."""
    grid = grid or {"p": [2, 3, 4, 8, 64], "n": [1, 1000, 2 ** 25]}
    points_ = [{}]
    for name in variables:
        points_ = [dict(pt, **{name: v}) for pt in points_ for v in grid[name]]
    extra = dict(tol_source=f"exact formula, compared at {len(points_)} points of {grid}", unit="",
                 tolerance=rel_tol)
    if answer is None or answer is ...:  # None, or otter's blank `...`
        verdict = f"[{qid}] not answered yet: write a formula in {', '.join(variables)} as a string"
        return _emit(_record(qid, "formula", None, expected_text, None, points, **extra), verdict)
    bad = None
    try:
        for pt in points_:
            got, want = eval_expr(str(answer), pt), float(expected(**pt))
            if not abs(got - want) <= rel_tol * max(abs(want), 1e-300):
                bad = (pt, got, want)
                break
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as e:
        bad = (None, None, str(e))
    ok = bad is None
    if ok:
        verdict = f"[{qid}] correct: {answer}" + (f" = {expected_text}" if expected_text else "")
    else:
        pt, got, want = bad
        where = (f"at {pt} yours gives {got:.6g}, expected {want:.6g}" if pt is not None
                 else f"could not evaluate it: {want}")
        verdict = (f"[{qid}] missed: {answer}: {where}" + (f"; the answer is {expected_text}" if expected_text
                   else "") + (f"\n  hint: {hint_on_miss}" if hint_on_miss else ""))
    return _emit(_record(qid, "formula", str(answer), expected_text, ok, points, **extra), verdict)


def check_exercise(qid: str, result, points: int = 1) -> Record:
    """A "build it yourself" check (a dtlab.course.exercises.ExerciseResult) as a graded answer: right when
    it passed; a stub counts as not answered; the feedback names what failed."""
    status = result.status
    ok = None if status == "not implemented" else bool(result.passed)
    verdict = f"[{qid}] {status}" + (": " + "; ".join(result.feedback) if result.feedback else "")
    return _emit(_record(qid, "exercise", status, "passed", ok, points, feedback=list(result.feedback)), verdict)


def graded(qid: str, env: dict | None = None) -> None:
    """The autograder's test of one question (`graded("lab01.q1", globals())` in a master's hidden test):
    passes when the notebook's last check of `qid` was right; raises AssertionError with the check's verdict
    (what was expected, the tolerance and its source, the hint) otherwise. `env`: the executed notebook's
    globals, where the checks leave their records; this process's records are used when it has none."""
    rec = ((env or {}).get(ANSWERS_VAR) or {}).get(qid) or RECORDED.get(qid)
    if rec is None:
        raise AssertionError(f"[{qid}] was never checked: run the notebook top to bottom")
    if not rec.get("ok"):
        raise AssertionError(rec.get("verdict") or f"[{qid}] not right")


def parse_answers(notebook_path) -> list[dict]:
    """Every answer recorded in an executed notebook's outputs, in cell order: the dtlab MIME type of
    display_data / execute_result outputs and `DTLAB-ANSWER {json}` lines of stream outputs (a line that does not
    parse as a JSON object with a qid is skipped). When a check ran
    twice in a notebook, both records are returned (the last one counts)."""
    with open(notebook_path, encoding="utf-8") as f:
        nb = json.load(f)
    out = []
    for cell in nb.get("cells", []):
        for o in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = o.get("data", {})
            if MIME in data:
                d = data[MIME]
                out.append(json.loads(d) if isinstance(d, str) else dict(d))
            elif o.get("output_type") == "stream":
                text = o.get("text", "")
                text = "".join(text) if isinstance(text, list) else text
                for line in text.splitlines():
                    if line.startswith(PREFIX):
                        try:
                            rec = json.loads(line[len(PREFIX):])
                        except ValueError:
                            continue   # a line that only looks like an answer
                        if isinstance(rec, dict) and "qid" in rec:
                            out.append(rec)
    return out


def score(answers: list[dict]) -> dict:
    """{qid: the last record of each qid}, and the totals: {"points", "max_points", "by_qid"}."""
    last = {a["qid"]: a for a in answers}
    return {"points": sum(a.get("points", 0) for a in last.values()),
            "max_points": sum(a.get("max_points", 0) for a in last.values()), "by_qid": last}
