"""dtlab.course.checks and verdicts: verdicts, tolerances (capped), records that never hold a key, the rubric's
keys, and the verdicts a grader reads back from a notebook's outputs (formative only)."""

import json
import math
import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

from dtlab.course import checks, rubric
from dtlab.course.checks import (
    check,
    check_choice,
    check_formula,
    check_number,
    parse_answers,
    score,
    tol_from_spread,
)
from dtlab.course.verdicts import MAX_REL_TOL, Key, eval_expr, judge

N_PARAMS = 66_955_010


GRAD_BYTES = 4 * N_PARAMS


HINTS = {0.25: "you counted parameters: DDP all-reduces 4-byte fp32 gradients"}


LABS = pathlib.Path(__file__).resolve().parents[2] / "labs"


def _key_free(rec, *keys):
    """No form of the key in the record (its JSON, verdict included)."""
    text = json.dumps(dict(rec))
    assert "expected" not in rec
    for k in keys:
        assert str(k) not in text and (not isinstance(k, int) or f"{k:,}" not in text), (k, text)


def test_right_number_passes_and_scores(capsys):
    rec = check_number("t.q1", GRAD_BYTES, GRAD_BYTES, rel_tol=0.01, tol_source="exact", unit="B", points=2)
    assert rec["ok"] is True and rec["points"] == 2 and rec["max_points"] == 2
    assert "correct" in capsys.readouterr().out


def test_rounded_number_is_within_tolerance(capsys):
    rec = check_number("t.q1", 268e6, GRAD_BYTES, rel_tol=0.01, tol_source="exact", unit="B")
    assert rec["ok"] is True and "within tolerance" in capsys.readouterr().out
    _key_free(rec, GRAD_BYTES)


def test_bytes_counted_once_instead_of_fp32_misses_with_the_hint_and_no_key(capsys):
    rec = check_number(
        "t.q1",
        N_PARAMS,
        GRAD_BYTES,
        rel_tol=0.01,
        tol_source="exact",
        unit="B",
        hint_on_miss="generic",
        ratio_hints=HINTS,
    )
    out = capsys.readouterr().out
    assert rec["ok"] is False and rec["points"] == 0 and rec["max_points"] == 1
    assert "missed" in out and "too low" in out and "4-byte fp32 gradients" in out and "generic" not in out
    _key_free(rec, GRAD_BYTES)
    assert f"{GRAD_BYTES:,}" not in out and str(GRAD_BYTES) not in out


def test_a_miss_without_a_matching_ratio_gets_the_generic_hint(capsys):
    rec = check_number(
        "t.q1",
        3 * GRAD_BYTES,
        GRAD_BYTES,
        rel_tol=0.01,
        tol_source="exact",
        unit="B",
        hint_on_miss="generic",
        ratio_hints=HINTS,
    )
    out = capsys.readouterr().out
    assert rec["ok"] is False and "hint: generic" in out and "too high" in out


def test_tolerance_edges():
    assert check_number("t", 10.9, 10, abs_tol=1, tol_source="s")["ok"] is True
    assert check_number("t", 11.1, 10, abs_tol=1, tol_source="s")["ok"] is False
    assert check_number("t", 11.9, 10, rel_tol=0.2, tol_source="s")["ok"] is True
    assert check_number("t", 12.1, 10, rel_tol=0.2, tol_source="s")["ok"] is False
    # both given: the larger one applies
    assert check_number("t", 12.9, 10, rel_tol=0.2, abs_tol=3, tol_source="s")["ok"] is True
    assert check_number("t", 10, 10, tol_source="s")["ok"] is True  # no tolerance: exact
    assert check_number("t", 10.001, 10, tol_source="s")["ok"] is False


def test_tolerances_are_capped_so_a_question_still_discriminates():
    """A measured 2.7 ms with a fit error of 58% and a spread of 58% once accepted 0.3 ms; capped at 50% it does
    not, and the verdict says the cap applied."""
    rec = check_number("t", 0.3, 2.7, rel_tol=1.16, unit="ms", tol_source="fit error + spread")
    assert rec["ok"] is False and rec["capped"] is True and rec["tolerance"] == MAX_REL_TOL
    assert "capped at 50%" in rec["verdict"]
    assert check_number("t", 1.36, 2.7, rel_tol=1.16, unit="ms", tol_source="s")["ok"] is True
    assert check_number("t", 1.34, 2.7, rel_tol=1.16, unit="ms", tol_source="s")["ok"] is False
    assert check_number("t", 40, 2.7, abs_tol=100, unit="ms", tol_source="s")["ok"] is False  # abs widths too


def test_an_absolute_width_is_shown_as_such_not_as_a_fraction_that_gives_the_key_away():
    rec = check_number("t", 150, 200, abs_tol=1.0, unit="ms", tol_source="1 ms for rounding")
    assert "± 1 ms" in rec["verdict"] and "0.5%" not in rec["verdict"]
    hidden = judge(Key("t", "number", 1000, abs_tol=37, tol_source="the model's error", show_tol=False), None)
    assert "37" not in hidden["verdict"] and "3.7%" not in hidden["verdict"]


def test_none_is_not_answered_never_raises_and_shows_no_key(capsys):
    rec = check_number("t.q1", None, 2.5, rel_tol=0.2, tol_source="spread", unit="ms")
    assert rec["ok"] is None and rec["answer"] is None and rec["points"] == 0
    assert "not answered yet" in capsys.readouterr().out
    _key_free(rec, 2.5)
    assert check_choice("t.q2", None, "abc", ["abc", "xyz"])["ok"] is None
    assert check_formula("t.q3", None, lambda p, n: n)["ok"] is None
    assert check_number("t.q1", ..., 2.5, rel_tol=0.2, tol_source="s")["ok"] is None  # otter's blank


def test_a_non_number_guess_is_a_miss_not_an_error():
    rec = check_number("t.q1", "about 1 ms", 1.0, rel_tol=0.5, tol_source="s", unit="ms")
    assert rec["ok"] is False and rec["answer"] == "about 1 ms"


def test_numpy_answers_are_recorded_as_json():
    np = pytest.importorskip("numpy")
    rec = check_number("t.q1", np.float64(GRAD_BYTES), np.int64(GRAD_BYTES), rel_tol=0.0, tol_source="s")
    json.dumps(dict(rec))
    assert rec["ok"] is True and rec["answer"] == GRAD_BYTES


@pytest.mark.parametrize(
    "values,method,want",
    [
        ([1, 2, 3, 4, 10], "range", (10 - 1) / 2 / 3),  # half the min..max range over the median
        ([1, 2, 3, 4, 10], "iqr", (4 - 2) / 2 / 3),  # half the interquartile range over the median
        ([10, 10, 10], "range", 0.0),
        ([5], "range", 0.0),  # one value: no spread to speak of
        ([1.0, float("nan"), 3.0], "range", (3 - 1) / 2 / 2),  # non-finite values dropped
    ],
)
def test_tol_from_spread_is_computed_as_documented(values, method, want):
    assert math.isclose(tol_from_spread(values, method), want)


def test_tol_from_spread_floor_and_bad_method():
    assert tol_from_spread([10, 10.1], floor=0.1) == 0.1
    assert tol_from_spread([1, 3], floor=0.1) == 0.5
    with pytest.raises(ValueError):
        tol_from_spread([1, 2], method="stdev")


def test_choice_right_wrong_unknown_and_ties_never_name_the_answer_on_a_miss(capsys):
    assert check_choice("t", "Last Ready", "last ready", ["first ready", "last ready"])["ok"] is True
    rec = check_choice(
        "t",
        "first ready",
        "last ready",
        ["first ready", "last ready"],
        explanation="the last one",
        hint="look at the timeline",
    )
    out = capsys.readouterr().out
    assert rec["ok"] is False and "look at the timeline" in out and "the last one" not in out
    assert "'last ready'" not in rec["verdict"] and "expected" not in rec
    assert check_choice("t", "middle", "last ready", ["first ready", "last ready"])["ok"] is False
    assert check_choice("t", 5, [5.0, 25.0], [1.0, 5.0, 25.0])["ok"] is True  # several right within noise
    assert check_choice("t", 1, [5.0, 25.0], [1.0, 5.0, 25.0])["ok"] is False


def test_formula_compared_on_a_grid_and_its_text_shown_only_once_right(capsys):
    ring = lambda p, n: 2 * (p - 1) / p * n  # noqa: E731
    assert check_formula("t", "2*(p-1)/p*n", ring, expected_text="2 (p-1)/p n")["ok"] is True
    assert "2 (p-1)/p n" in capsys.readouterr().out  # shown once right
    assert check_formula("t", "2 * n * (1 - 1/p)", ring)["ok"] is True  # same function, other form
    rec = check_formula("t", "n / p", ring, expected_text="2 (p-1)/p n")  # the textbook term
    assert rec["ok"] is False and "2 (p-1)/p n" not in capsys.readouterr().out and "expected" not in rec
    assert check_formula("t", "n", ring)["ok"] is False  # right at p = 2 only
    rec = check_formula("t", "__import__('os').getcwd()", ring)  # never evaluated
    assert rec["ok"] is False and "not allowed" in capsys.readouterr().out
    assert check_formula("t", "n /", ring)["ok"] is False  # syntax error: a miss


def test_eval_expr_refuses_names_and_calls():
    assert eval_expr("2^3 + p", {"p": 1}) == 9
    with pytest.raises(ValueError):
        eval_expr("q", {"p": 1})
    with pytest.raises(ValueError):
        eval_expr("abs(p)", {"p": 1})


def test_the_rubric_is_the_readme_table_and_its_derived_keys_are_right():
    """Every lab's questions and points are labs/README.md's rubric; derived keys (no run needed) accept their
    answers and refuse the usual slips; a missing source is named."""
    table = {
        q: int(p)
        for q, p in re.findall(r"^\| `(lab\d\d\.\w+)` \| (\d+) \|", (LABS / "README.md").read_text(), flags=re.M)
    }
    ours = {q.qid: q.points for lab in rubric.LAB_MODULES for q in rubric.questions(lab)}
    assert ours == table
    right = {
        "lab02.q4": "2*(p-1)",
        "lab05.q4": "bandwidth (beta)",
        "lab06.q2": 200,
        "lab06.q3": "2*p*n",
        "lab07.q3": "2*(N-1)/N*n",
        "lab08.q1": 2,
        "lab08.q2": 2,
        "lab08.q3": "(p-1)*n",
    }
    wrong = {
        "lab02.q4": "2*(p-1)/p*n",
        "lab05.q4": "both",
        "lab06.q2": 100,
        "lab06.q3": "2*(p-1)*n",
        "lab07.q3": "2*(N-1)*n",
        "lab08.q1": 1,
        "lab08.q2": 1,
        "lab08.q3": "2*(p-1)/p*n",
    }
    for qid, answer in right.items():
        assert judge(rubric.key(qid), answer)["ok"] is True, qid
        assert judge(rubric.key(qid), wrong[qid])["ok"] is False, qid
    with pytest.raises(ValueError, match="needs run"):
        check("lab01.q1", 4, profile=None)
    with pytest.raises(ValueError, match="unknown|not a graded"):
        check("lab01.q9", 4)


def test_score_takes_the_last_record_per_qid():
    recs = [
        {"qid": "a", "points": 0, "max_points": 2},
        {"qid": "a", "points": 2, "max_points": 2},
        {"qid": "b", "points": 0, "max_points": 1},
    ]
    s = score(recs)
    assert s["points"] == 2 and s["max_points"] == 3 and s["by_qid"]["a"]["points"] == 2


def test_parse_answers_reads_back_exactly_what_an_executed_notebook_recorded(tmp_path):
    """A small notebook: checks with the dtlab MIME output, one check that ends a cell, a check printed as a
    DTLAB-ANSWER line (outside IPython's display), and ordinary outputs that must be ignored."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# tiny"),
        nbformat.v4.new_code_cell(
            "from dtlab.course.checks import check_number, check_choice, check_formula\n"
            "print('DTLAB-ANSWER is only a prefix at the start of a line')\n"
            "{'qid': 'not.an.answer'}"
        ),
        nbformat.v4.new_code_cell(
            f"check_number('nb.q1', {N_PARAMS}, {GRAD_BYTES}, rel_tol=0.01, "
            "tol_source='exact', unit='B', ratio_hints={0.25: 'x4'})\n"
            "check_choice('nb.q2', 'last', 'last', ['first', 'last'])"
        ),
        nbformat.v4.new_code_cell("check_formula('nb.q3', None, lambda p, n: n)"),
        nbformat.v4.new_code_cell(
            "import json, dtlab.course.checks as c\n"
            "print(c.PREFIX + json.dumps({'qid': 'nb.q4', 'answer': 3, "
            "'ok': True, 'points': 1, 'max_points': 1}))"
        ),
    ]
    path = tmp_path / "tiny.ipynb"
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(nb, path)
    got = parse_answers(path)
    assert [a["qid"] for a in got] == ["nb.q1", "nb.q2", "nb.q3", "nb.q4"]
    q1, q2, q3, q4 = got
    assert (q1["answer"], q1["ok"], q1["points"], q1["max_points"]) == (N_PARAMS, False, 0, 1)
    assert "expected" not in q1 and str(GRAD_BYTES) not in json.dumps(q1)
    assert (q2["answer"], q2["ok"], q2["points"]) == ("last", True, 1)
    assert q3["answer"] is None and q3["ok"] is None
    assert q4["answer"] == 3 and q4["ok"] is True
    # a student sees the verdict, not the JSON: the check's output is text/plain plus the dtlab MIME type
    outs = [o for o in nb.cells[2].outputs if checks.MIME in o.get("data", {})]
    assert len(outs) == 2 and "missed" in outs[0]["data"]["text/plain"] and "x4" in outs[0]["data"]["text/plain"]
    # and the check ending a cell did not add a dict repr (Record displays as nothing)
    assert all(o.get("output_type") != "execute_result" for o in nb.cells[3].outputs)
