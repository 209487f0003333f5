"""Keys and verdicts: a question's right answer (a `Key`) and a student's answer judged against it (`judge`).

Pure (no torch, no IPython). The notebook's formative checks (dtlab.course.checks) and the autograder
(dtlab.course.grader, a process of its own) both call `judge`, so the notebook shows the verdict the grade gives.

A verdict never contains the key. It says correct / missed / not answered yet; for a number, the tolerance as a
relative width with its source, and on a miss whether the answer is too high or too low and a hint; for a choice,
the explanation once the answer is right and a hint otherwise; for a formula, a point where it differs. The
record a verdict returns holds the student's answer, right or wrong, points, the tolerance's relative width and
source: never the expected value, the right choice or the formula.

Tolerances are capped at MAX_REL_TOL (50%) of the expected value: a measurement too noisy for that cannot make a
question meaningless, the cap applies and the verdict says so.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, field

MAX_REL_TOL = 0.5
KINDS = ("number", "choice", "formula", "exercise")


@dataclass
class Key:
    """One question's key, computed from the lab's recordings or derived (see dtlab.course.rubric).

    kind "number": `expected` a number, tolerance max(abs_tol, rel_tol x |expected|), capped; "choice": `expected`
    the right choice or a list of choices that are all right, `choices` every allowed one; "formula": `expected` a
    function of `variables`, compared on `grid`; "exercise": `expected` an ExerciseResult-like object (status,
    passed, feedback) of the student's own code. `tol_source` says where the tolerance comes from, `hint` what to
    reconsider after a miss (never the answer), `ratio_hints` {answer / expected: hint} for known mistakes,
    `explanation` why, shown once the answer is right; `show_tol` False where the tolerance's width would give the
    key away (one derived from the key itself). `env` {name: number}: the lab's values an answer given as a string
    may name ("ceil(epoch_samples / samples_per_step) * t_step_s / 3600"), so a re-run of the lab recomputes the
    answer from its own run; `graded_on` names what the key was computed from (the run and its T_step), said by the
    grader beside every grade (never a key)."""

    qid: str
    kind: str
    expected: object
    points: int = 1
    rel_tol: float | None = None
    abs_tol: float | None = None
    tol_source: str = ""
    unit: str = ""
    choices: tuple = ()
    hint: str = ""
    ratio_hints: dict = field(default_factory=dict)
    explanation: str = ""
    variables: tuple = ("p", "n")
    grid: dict | None = None
    show_tol: bool = True
    env: dict = field(default_factory=dict)
    graded_on: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "number" and not finite(self.expected):
            raise ValueError(f"{self.qid}: expected must be a finite number, got {self.expected!r}")


def finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def fmt(x, unit: str = "") -> str:
    """A number as a verdict writes it: thousands separators for large values, 4 significant digits otherwise."""
    if isinstance(x, str) and (unit in x or not finite(x)):
        return x.strip()  # a string answer that names its unit (said once), or an expression
    if isinstance(x, bool) or not finite(x):
        s = str(x)
    elif isinstance(x, int) or float(x) == int(float(x)) and abs(float(x)) >= 1e4:
        s = f"{int(float(x)):,}"
    else:
        s = f"{float(x):,.0f}" if abs(float(x)) >= 1e4 else f"{float(x):.4g}"
    return f"{s} {unit}".rstrip()


def unanswered(answer) -> bool:
    """None, or otter's blank `...`."""
    return answer is None or answer is ...


def tolerance(key: Key) -> tuple[float, bool]:
    """(absolute tolerance, capped?) of a number key: max(abs_tol, rel_tol x |expected|), at most
    MAX_REL_TOL x |expected| (a zero expected value keeps abs_tol)."""
    exp = abs(float(key.expected))
    tol = max(key.abs_tol or 0.0, (key.rel_tol or 0.0) * exp)
    cap = MAX_REL_TOL * exp
    return (cap, True) if exp > 0 and tol > cap else (tol, False)


def _record(key: Key, answer, ok, verdict: str, **extra) -> dict:
    return {
        "qid": key.qid,
        "kind": key.kind,
        "answer": answer,
        "ok": ok,
        "points": key.points if ok else 0,
        "max_points": key.points,
        "tol_source": key.tol_source,
        "unit": key.unit,
        "verdict": verdict,
        **extra,
    }


def _plain(answer):
    """The answer as a record keeps it: a JSON value."""
    if isinstance(answer, (bool, int, float, str)) or answer is None:
        return answer
    try:
        f = float(answer)
        return int(f) if f.is_integer() and abs(f) < 2**53 and not isinstance(answer, float) else f
    except (TypeError, ValueError, OverflowError):
        return str(answer)[:200]


def judge_number(key: Key, answer) -> dict:
    """A number answer against a number key."""
    tol, capped = tolerance(key)
    exp = float(key.expected)
    by_abs = not capped and (key.abs_tol or 0.0) >= (key.rel_tol or 0.0) * abs(exp)
    # an absolute width is shown as such: as a fraction of the key, a fixed width would give the key away
    width = "exact" if not tol else f"± {fmt(tol, key.unit)}" if by_abs or not exp else f"±{tol / abs(exp):.1%}"
    width = width + " (capped at 50%)" if capped else width
    # a hidden width names only its source: "tolerance the tolerance; ..." said nothing twice
    tol_txt = f"{width}; {key.tol_source}" if key.show_tol else key.tol_source
    extra = {"tolerance": tol / abs(exp) if exp else tol, "capped": capped}
    if unanswered(answer):
        return _record(
            key,
            None,
            None,
            f"[{key.qid}] not answered yet: set your answer and run this cell again (tolerance {tol_txt})",
            **extra,
        )
    g, how = value_of(answer, key.env)
    ok = bool(abs(g - exp) <= tol)
    if ok:
        word = "correct" if abs(g - exp) <= 1e-9 * max(1.0, abs(exp)) else "within tolerance"
        return _record(
            key, _plain(answer), True, f"[{key.qid}] {word}: you said {fmt(answer, key.unit)}{how} ({tol_txt})", **extra
        )
    hint = key.hint
    if math.isfinite(g) and exp:
        for ratio, text in key.ratio_hints.items():
            if ratio and abs(g / exp / ratio - 1) <= 0.05:
                hint = text
                break
    side = "" if not math.isfinite(g) else (", too high" if g > exp else ", too low")
    verdict = f"[{key.qid}] missed: you said {fmt(answer, key.unit)}{how}{side} (outside {tol_txt})" + (
        f"\n  hint: {hint}" if hint else ""
    )
    return _record(key, _plain(answer), False, verdict, **extra)


FUNCTIONS = {"ceil": math.ceil, "floor": math.floor, "sqrt": math.sqrt}


def value_of(answer, env: dict) -> tuple[float, str]:
    """(the answer's value, how it was read): a number as it is; a string as a number, else as an expression of
    `env`'s names (and ceil, floor, sqrt), evaluated with this run's values (", which is X here"); NaN when it is
    neither."""
    try:
        return float(answer), ""
    except (TypeError, ValueError, OverflowError):
        pass
    if isinstance(answer, str) and env:
        try:
            g = eval_expr(answer, {**env, **FUNCTIONS})
            return g, f", which is {fmt(g)} with this run's values"
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError):
            return float("nan"), f" (an expression of {', '.join(sorted(env))} could not be evaluated)"
    return float("nan"), ""


def _norm(x):
    return " ".join(str(x).lower().split()) if isinstance(x, str) else x


def judge_choice(key: Key, answer) -> dict:
    """A choice against the right one(s); strings compare case- and space-insensitively."""
    right = list(key.expected) if isinstance(key.expected, (list, tuple, set)) else [key.expected]
    choices = list(key.choices)
    extra = {"choices": choices}
    if unanswered(answer):
        return _record(key, None, None, f"[{key.qid}] not answered yet: pick one of {choices}", **extra)
    known = [c for c in choices if _norm(c) == _norm(answer)]
    ok = bool(known) and any(_norm(c) == _norm(answer) for c in right)
    if not known:
        verdict = f"[{key.qid}] missed: {answer!r} is not one of {choices}"
    elif ok:
        verdict = f"[{key.qid}] correct: {answer!r}" + (f"\n  why: {key.explanation}" if key.explanation else "")
    else:
        verdict = f"[{key.qid}] missed: you chose {answer!r}" + (f"\n  hint: {key.hint}" if key.hint else "")
    return _record(key, _plain(answer), ok, verdict, **extra)


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def eval_expr(expr: str, env: dict) -> float:
    """Evaluate an arithmetic formula (numbers, the names in `env`, + - * / ** and parentheses; `^` is read
    as a power; a name whose value is a function in `env`, such as ceil, may be called). Anything else raises
    ValueError: no other calls, no attributes."""
    tree = ast.parse(expr.replace("^", "**"), mode="eval")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.Name) and node.id in env and not callable(env[node.id]):
            return float(env[node.id])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and callable(env.get(node.func.id)):
            if node.keywords:
                raise ValueError(f"not allowed in a formula: {ast.unparse(node)!r} (no keyword arguments)")
            return float(env[node.func.id](*[ev(a) for a in node.args]))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(
            f"not allowed in a formula: {ast.unparse(node)!r} (use {sorted(env)}, numbers, + - * / ** and parentheses)"
        )

    return ev(tree)


DEFAULT_GRID = {"p": [2, 3, 4, 8, 64], "n": [1, 1000, 2**25]}


def grid_points(variables, grid) -> list[dict]:
    """Every combination of the grid's values for `variables`."""
    pts = [{}]
    for name in variables:
        pts = [dict(pt, **{name: v}) for pt in pts for v in grid[name]]
    return pts


def judge_formula(key: Key, answer, rel_tol: float = 1e-6) -> dict:
    """A formula string in key.variables against key.expected(**point) at every grid point (float rounding)."""
    grid = key.grid or DEFAULT_GRID
    pts = grid_points(key.variables, grid)
    extra = {"tolerance": rel_tol}
    if unanswered(answer):
        return _record(
            key,
            None,
            None,
            f"[{key.qid}] not answered yet: write a formula in {', '.join(key.variables)} as a string",
            **extra,
        )
    where = None
    try:
        for pt in pts:
            got, want = eval_expr(str(answer), pt), float(key.expected(**pt))
            if not abs(got - want) <= rel_tol * max(abs(want), 1e-300):
                where = f"at {', '.join(f'{k} = {v:,}' for k, v in pt.items())} yours gives {got:.6g}, not the model's"
                break
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError) as e:
        where = f"could not evaluate it: {e}"
    ok = where is None
    verdict = (
        f"[{key.qid}] correct: {answer}" + (f"\n  why: {key.explanation}" if key.explanation else "")
        if ok
        else f"[{key.qid}] missed: {answer}: {where}" + (f"\n  hint: {key.hint}" if key.hint else "")
    )
    return _record(key, str(answer), ok, verdict, **extra)


def judge_exercise(key: Key, answer=None) -> dict:
    """A "build it yourself" result (key.expected: status, passed, feedback): right when it passed, a stub is not
    answered, the feedback names what failed."""
    res = key.expected
    status = res.status
    ok = None if status == "not implemented" else bool(res.passed)
    verdict = f"[{key.qid}] {status}" + (": " + "; ".join(res.feedback) if res.feedback else "")
    return _record(key, status, ok, verdict, feedback=list(res.feedback))


def judge(key: Key, answer) -> dict:
    """The verdict record of `answer` against `key` (see the module's docstring): qid, kind, answer, ok (True,
    False, or None when not answered), points, max_points, tol_source, unit, verdict (text), and per kind the
    tolerance's relative width, whether it was capped, or the allowed choices."""
    return {"number": judge_number, "choice": judge_choice, "formula": judge_formula, "exercise": judge_exercise}[
        key.kind
    ](key, answer)
