"""dtlab.course.checks: verdicts, tolerances and the answers a grader reads back from a notebook's outputs."""

import json
import math

import nbformat
import pytest
from nbclient import NotebookClient

from dtlab.course import checks
from dtlab.course.checks import (check_choice, check_formula, check_number, eval_expr, parse_answers, score,
                                 tol_from_spread)

N_PARAMS = 66_955_010
GRAD_BYTES = 4 * N_PARAMS
HINTS = {0.25: "you counted parameters: DDP all-reduces 4-byte fp32 gradients"}


def test_right_number_passes_and_scores(capsys):
    rec = check_number("t.q1", GRAD_BYTES, GRAD_BYTES, rel_tol=0.01, tol_source="exact", unit="B", points=2)
    assert rec["ok"] is True and rec["points"] == 2 and rec["max_points"] == 2
    assert "correct" in capsys.readouterr().out


def test_rounded_number_is_within_tolerance(capsys):
    rec = check_number("t.q1", 268e6, GRAD_BYTES, rel_tol=0.01, tol_source="exact", unit="B")
    assert rec["ok"] is True and "within tolerance" in capsys.readouterr().out


def test_bytes_counted_once_instead_of_fp32_misses_with_the_hint(capsys):
    rec = check_number("t.q1", N_PARAMS, GRAD_BYTES, rel_tol=0.01, tol_source="exact", unit="B",
                       hint_on_miss="generic", ratio_hints=HINTS)
    out = capsys.readouterr().out
    assert rec["ok"] is False and rec["points"] == 0 and rec["max_points"] == 1
    assert "missed" in out and "4-byte fp32 gradients" in out and "generic" not in out
    assert f"{GRAD_BYTES:,} B" in out  # the expected value, with its unit


def test_a_miss_without_a_matching_ratio_gets_the_generic_hint(capsys):
    rec = check_number("t.q1", 3 * GRAD_BYTES, GRAD_BYTES, rel_tol=0.01, tol_source="exact", unit="B",
                       hint_on_miss="generic", ratio_hints=HINTS)
    assert rec["ok"] is False and "hint: generic" in capsys.readouterr().out


def test_tolerance_edges():
    assert check_number("t", 10.9, 10, abs_tol=1, tol_source="s")["ok"] is True
    assert check_number("t", 11.1, 10, abs_tol=1, tol_source="s")["ok"] is False
    assert check_number("t", 11.9, 10, rel_tol=0.2, tol_source="s")["ok"] is True
    assert check_number("t", 12.1, 10, rel_tol=0.2, tol_source="s")["ok"] is False
    # both given: the larger one applies
    assert check_number("t", 12.5, 10, rel_tol=0.2, abs_tol=3, tol_source="s")["tolerance"] == 3
    assert check_number("t", 10, 10, tol_source="s")["ok"] is True   # no tolerance: exact


def test_none_is_not_answered_and_never_raises(capsys):
    rec = check_number("t.q1", None, 2.5, rel_tol=0.2, tol_source="spread", unit="ms")
    assert rec["ok"] is None and rec["answer"] is None and rec["points"] == 0 and rec["expected"] == 2.5
    assert "not answered yet" in capsys.readouterr().out
    assert check_choice("t.q2", None, "a", ["a", "b"])["ok"] is None
    assert check_formula("t.q3", None, lambda p, n: n)["ok"] is None


def test_a_non_number_guess_is_a_miss_not_an_error():
    rec = check_number("t.q1", "about 1 ms", 1.0, rel_tol=0.5, tol_source="s", unit="ms")
    assert rec["ok"] is False and rec["answer"] == "about 1 ms"


def test_numpy_expected_values_are_recorded_as_json():
    np = pytest.importorskip("numpy")
    rec = check_number("t.q1", 1, np.int64(GRAD_BYTES), rel_tol=0.0, tol_source="s")
    json.dumps(dict(rec))
    assert rec["expected"] == GRAD_BYTES


@pytest.mark.parametrize("values,method,want", [
    ([1, 2, 3, 4, 10], "range", (10 - 1) / 2 / 3),        # half the min..max range over the median
    ([1, 2, 3, 4, 10], "iqr", (4 - 2) / 2 / 3),           # half the interquartile range over the median
    ([10, 10, 10], "range", 0.0),
    ([5], "range", 0.0),                                  # one value: no spread to speak of
    ([1.0, float("nan"), 3.0], "range", (3 - 1) / 2 / 2),  # non-finite values dropped
])
def test_tol_from_spread_is_computed_as_documented(values, method, want):
    assert math.isclose(tol_from_spread(values, method), want)


def test_tol_from_spread_floor_and_bad_method():
    assert tol_from_spread([10, 10.1], floor=0.1) == 0.1
    assert tol_from_spread([1, 3], floor=0.1) == 0.5
    with pytest.raises(ValueError):
        tol_from_spread([1, 2], method="stdev")


def test_choice_right_wrong_unknown_and_ties(capsys):
    assert check_choice("t", "Last Ready", "last ready", ["first ready", "last ready"])["ok"] is True
    rec = check_choice("t", "first ready", "last ready", ["first ready", "last ready"], explanation="why not")
    assert rec["ok"] is False and "why not" in capsys.readouterr().out
    assert check_choice("t", "middle", "last ready", ["first ready", "last ready"])["ok"] is False
    assert check_choice("t", 5, [5.0, 25.0], [1.0, 5.0, 25.0])["ok"] is True    # several right within noise
    assert check_choice("t", 1, [5.0, 25.0], [1.0, 5.0, 25.0])["ok"] is False


def test_formula_compared_on_a_grid(capsys):
    ring = lambda p, n: 2 * (p - 1) / p * n  # noqa: E731
    assert check_formula("t", "2*(p-1)/p*n", ring)["ok"] is True
    assert check_formula("t", "2 * n * (1 - 1/p)", ring)["ok"] is True      # same function, other form
    assert check_formula("t", "n / p", ring)["ok"] is False                 # the textbook term
    assert check_formula("t", "n", ring)["ok"] is False                     # right at p = 2 only
    rec = check_formula("t", "__import__('os').getcwd()", ring)             # never evaluated
    assert rec["ok"] is False and "not allowed" in capsys.readouterr().out
    assert check_formula("t", "n /", ring)["ok"] is False                   # syntax error: a miss


def test_eval_expr_refuses_names_and_calls():
    assert eval_expr("2^3 + p", {"p": 1}) == 9
    with pytest.raises(ValueError):
        eval_expr("q", {"p": 1})
    with pytest.raises(ValueError):
        eval_expr("abs(p)", {"p": 1})


def test_score_takes_the_last_record_per_qid():
    recs = [{"qid": "a", "points": 0, "max_points": 2}, {"qid": "a", "points": 2, "max_points": 2},
            {"qid": "b", "points": 0, "max_points": 1}]
    s = score(recs)
    assert s["points"] == 2 and s["max_points"] == 3 and s["by_qid"]["a"]["points"] == 2


def test_parse_answers_reads_back_exactly_what_an_executed_notebook_recorded(tmp_path):
    """A small notebook: checks with the dtlab MIME output, one check that ends a cell, a check printed as a
    DTLAB-ANSWER line (outside IPython's display), and ordinary outputs that must be ignored."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# tiny"),
        nbformat.v4.new_code_cell("from dtlab.course.checks import check_number, check_choice, check_formula\n"
                                  "print('DTLAB-ANSWER is only a prefix at the start of a line')\n"
                                  "{'qid': 'not.an.answer'}"),
        nbformat.v4.new_code_cell(f"check_number('nb.q1', {N_PARAMS}, {GRAD_BYTES}, rel_tol=0.01, "
                                  "tol_source='exact', unit='B', ratio_hints={0.25: 'x4'})\n"
                                  "check_choice('nb.q2', 'last', 'last', ['first', 'last'])"),
        nbformat.v4.new_code_cell("check_formula('nb.q3', None, lambda p, n: n)"),
        nbformat.v4.new_code_cell("import json, dtlab.course.checks as c\n"
                                  "print(c.PREFIX + json.dumps({'qid': 'nb.q4', 'answer': 3, 'expected': 3, "
                                  "'ok': True, 'points': 1, 'max_points': 1}))"),
    ]
    path = tmp_path / "tiny.ipynb"
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(nb, path)
    got = parse_answers(path)
    assert [a["qid"] for a in got] == ["nb.q1", "nb.q2", "nb.q3", "nb.q4"]
    q1, q2, q3, q4 = got
    assert (q1["answer"], q1["expected"], q1["ok"], q1["points"], q1["max_points"]) == (N_PARAMS, GRAD_BYTES,
                                                                                       False, 0, 1)
    assert (q2["answer"], q2["ok"], q2["points"]) == ("last", True, 1)
    assert q3["answer"] is None and q3["ok"] is None
    assert q4["answer"] == 3 and q4["ok"] is True
    # a student sees the verdict, not the JSON: the check's output is text/plain plus the dtlab MIME type
    outs = [o for o in nb.cells[2].outputs if checks.MIME in o.get("data", {})]
    assert len(outs) == 2 and "missed" in outs[0]["data"]["text/plain"] and "x4" in outs[0]["data"]["text/plain"]
    # and the check ending a cell did not add a dict repr (Record displays as nothing)
    assert all(o.get("output_type") != "execute_result" for o in nb.cells[3].outputs)
