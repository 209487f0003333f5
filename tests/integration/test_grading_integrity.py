"""The autograder with a real kernel: a student's exception is reported with its cell and the rest still graded. The
autograder's other rules: tests/unit/test_grading_integrity.py."""

from dtlab.course import grader


def test_a_students_exception_is_reported_with_its_cell_and_the_rest_still_graded(tmp_path):
    """A small lab 08 notebook (its derived questions need no run) whose second cell raises: the error is named
    with its cell, the cells after it still ran, and a function never defined counts as not answered."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("my_factor_guess = 2"),
        nbformat.v4.new_code_cell("my_allreduce_hook = undefined_helper(3)"),
        nbformat.v4.new_code_cell("my_sends_guess = 2\nmy_bytes_guess = '(p - 1) * n'"),
    ]
    path = tmp_path / "08_build_it_yourself.ipynb"
    nbformat.write(nb, path)
    res = grader.grade_notebook(str(path), "08_build_it_yourself", cell_timeout_s=120)
    rows = {r["question"]: r for r in res["rows"]}
    assert res["errors"] == ["NameError: name 'undefined_helper' is not defined (cell 2)"] and res["mode"] == "quick"
    assert [rows[q]["points"] for q in ("lab08.q1", "lab08.q2", "lab08.q3")] == [1, 1, 2]
    assert rows["lab08.hook"]["points"] == 0 and "undefined_helper" in rows["lab08.hook"]["feedback"]
    assert "my_allreduce_hook: not defined after the notebook ran" in rows["lab08.hook"]["feedback"]
