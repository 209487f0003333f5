"""The scan for a key shown before its question (dtlab.course.reveal) on hand-made executed notebooks: a planted key
is found above the answer cell and in the check cell, a number outside the tolerance is not, and numbers after the
answer cell are ignored. tests/e2e/test_no_key.py runs it on every lab."""

import nbformat
import pytest

from dtlab.course.reveal import answer_cell, check_cells, numbers_in, scan

KEYS = {"lab12.q1": {"var": "my_gpu_hours", "expected": 0.01673, "tol": 0.01673 * 0.05, "unit": "GPU-hours"}}


def _nb(*cells):
    """cells: (source, printed text) of code cells, or a bare string for a markdown cell."""
    nb = nbformat.v4.new_notebook()
    for c in cells:
        if isinstance(c, str):
            nb.cells.append(nbformat.v4.new_markdown_cell(c))
            continue
        src, out = c
        cell = nbformat.v4.new_code_cell(src)
        if out:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=out)]
        nb.cells.append(cell)
    return nb


def _lab(before="T_step 57.2 ms", check_out="[lab12.q1] not answered yet", after="epoch: 0.01673 GPU-hours"):
    return _nb(
        ("run = dtlab.run(cfg)", before),
        "**Predict.** GPU-hours for one epoch?",
        ("my_gpu_hours = None", ""),
        ('check("lab12.q1", my_gpu_hours, run=run)', check_out),
        ("print(bill)", after),
    )


def test_a_planted_key_above_the_answer_is_found():
    found = scan(_lab(before="the epoch takes 0.0168 GPU-hours"), KEYS)
    assert [(f["qid"], f["cell"], f["where"], f["shown"]) for f in found] == [
        ("lab12.q1", 0, "above its answer cell", "0.0168")
    ]


def test_a_planted_key_in_the_check_cell_is_found_unless_answered():
    nb = _lab(check_out="not answered yet\nepoch: 1,053 step(s), $0.03346, 0.01673 GPU-hours")
    assert [f["where"] for f in scan(nb, KEYS)] == ["in its check cell"]
    assert scan(nb, KEYS, skip_checks=("lab12.q1",)) == []  # answered: the check may show what it earned


def test_a_number_outside_the_tolerance_is_not_found():
    # 5% of 0.01673 is 0.00084: 0.0177 lies outside, 0.01673 x 2 too (the price's factor)
    assert scan(_lab(before="0.0177 GPU-hours at another T_step; 0.03346 USD"), KEYS) == []


def test_numbers_after_the_answer_cell_are_ignored():
    assert scan(_lab(after="epoch: 0.01673 GPU-hours, exactly the key"), KEYS) == []


def test_units_are_read_in_the_keys_unit_and_counts_are_not_readings():
    keys = {"lab09.q5": {"var": "my_t", "expected": 5.408, "tol": 5.408 * 0.3, "unit": "s"}}
    nb = _nb(
        ("x = 1", "64 samples, 4.2 MB, 5 steps; local SGD: 5,378 ms to the target; table: 5.41"), ("my_t = None", "")
    )
    # 5 steps and 4.2 MB lie within 30% of 5.408 but are no reading of seconds; 5,378 ms and a bare 5.41 are
    assert [f["shown"] for f in scan(nb, keys)] == ["5,378 ms", "5.41"]
    # a bare number within the tolerance but not within 2% of the key: another column, not a reading
    wide = {"lab06.q1": {"var": "my_t", "expected": 44.57, "tol": 22.29, "unit": "ms"}}
    table = "rank compute (ms) wait (ms)\n0  66.7  3.98\n1  44.9  2.91"
    assert [f["shown"] for f in scan(_nb(("x", table), ("my_t = None", "")), wide)] == ["44.9"]
    usd = {"lab12.q2": {"var": "my_t", "expected": 0.1174, "tol": 0.006, "unit": "USD"}}
    assert [f["shown"] for f in scan(_nb(("x", "$0.1174 on-demand, 0.12 s"), ("my_t = None", "")), usd)] == ["$0.1174"]
    got = [(n["value"], n["kind"], n["digits"]) for n in numbers_in("3.9 MB and -2e3 B, 15%, $0.05869")]
    assert got == [(3.9, "bytes", 2), (-2000.0, "bytes", 1), (15.0, "fraction", 2), (0.05869, "USD", 4)]


def test_answer_and_check_cells_are_found_by_their_source():
    nb = _lab()
    assert answer_cell(nb, "my_gpu_hours") == 2 and check_cells(nb, "lab12.q1") == [3]
    with pytest.raises(ValueError, match="my_missing"):
        scan(nb, {"lab00.q1": {"var": "my_missing", "expected": 1.0, "tol": 0.0}})


def test_an_input_the_question_gives_is_no_reveal_when_the_model_was_right():
    # lab 6 asks for rank 0's wait growth from the reference table: (2 - 1) x rank 1's compute. When the straggler
    # run measures a growth within 2% of that input, the input is printed near the key by design.
    table = "rank compute (ms) wait (ms)\n0  32.0  0.412\n1  30.5  0\n"
    given = {"lab06.q1": {"var": "my_t", "expected": 30.71, "tol": 15.4, "unit": "ms", "given": [31.98, 30.46, 0.412]}}
    nb = _nb(("ref", table), ("my_t = None", ""))
    assert scan(nb, given) == []
    # the same table without the question's inputs named: rank 1's compute is found, as before
    bare = {q: {k: v for k, v in d.items() if k != "given"} for q, d in given.items()}
    assert [f["shown"] for f in scan(nb, bare)] == ["30.5"]
    # a number near the key that does not print a given (the straggler run's growth, 30.7) is still found, and so
    # is a given printed more finely than its value allows (30.46 shown as 30.7: not that input)
    leak = _nb(("ref", table + "growth 30.7 ms\n"), ("my_t = None", ""))
    assert [f["shown"] for f in scan(leak, given)] == ["30.7 ms"]
    # a given in the key's unit exempts a number written in another unit of its kind only within that number's
    # printed precision: 0.0305 s stands for 30.45 to 30.55 ms and prints 30.46 ms; 0.0307 s does not
    assert scan(_nb(("ref", "rank 1: 0.0305 s"), ("my_t = None", "")), given) == []
    assert [f["shown"] for f in scan(_nb(("ref", "rank 1: 0.0307 s"), ("my_t = None", "")), given)] == ["0.0307 s"]


def test_an_exact_count_is_read_only_from_a_whole_number():
    # lab 6 asks how many steps are redone (exact, 1 step); a ratio table above it printed 1.00
    count = {"lab06.q4": {"var": "my_n", "expected": 1.0, "tol": 0.0, "unit": "steps"}}
    assert scan(_nb(("x", "PS / ring (ratio)\n2  1.00  1.33"), ("my_n = None", "")), count) == []
    # a ratio key of 2 with a tolerance (lab 8's speed-up) is no count: a printed 2.00 is a reading of it
    ratio = {"lab08.q1": {"var": "my_n", "expected": 2.0, "tol": 0.02, "unit": ""}}
    assert [f["shown"] for f in scan(_nb(("x", "ratio 2.00"), ("my_n = None", "")), ratio)] == ["2.00"]
    # a count of 120 steps printed whole (3 digits) is a reading of a key of 120; 120.0 is not
    many = {"lab06.q4": {"var": "my_n", "expected": 120.0, "tol": 0.0, "unit": "steps"}}
    assert [f["shown"] for f in scan(_nb(("x", "redone: 120 of 400; mean 120.0"), ("my_n = None", "")), many)] == [
        "120"
    ]
