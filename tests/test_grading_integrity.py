"""The autograder's side, cheaply: keys computed from a recording found by the lab's config, the recording's
consistency checks (each tampering found and named), the check-cell fingerprints, the otter hidden test's
separate process, and a student's exception reported with its cell. Reuses the session's one tiny run
(conftest.tiny_run: the quick-mode lab config) and edits copies of it; one small notebook runs in a kernel."""

import json
import pathlib
import shutil

import pytest

from dtlab.course import grader, integrity
from dtlab.course.recordings import Recordings
from dtlab.results.run import load_run

LABS = pathlib.Path(__file__).resolve().parent.parent / "labs"
LAB01 = "01_ddp_breakdown"


@pytest.fixture
def copy(tiny_run, tmp_path, monkeypatch):
    """A fresh copy of the tiny run under tmp/runs/, graded as if lab 01 had run there in quick mode."""
    monkeypatch.setenv("DTLAB_QUICK", "1")
    d = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.path, d)
    return d


def _edit_events(d, rank, fn):
    path = d / "events" / f"rank{rank}.jsonl"
    evs = [json.loads(line) for line in path.read_text().splitlines()]
    fn(evs)
    path.write_text("".join(json.dumps(e) + "\n" for e in evs))


def _grade(root, tmp_path, **answers):
    rows = grader.grade_answers(LAB01, {k: {"value": v} for k, v in answers.items()}, Recordings(root, False),
                                str(tmp_path))
    return {r["question"]: r for r in rows}


def test_a_consistent_run_is_graded_from_the_architecture_and_its_records(copy, tmp_path, tiny_run):
    assert integrity.run_problems(load_run(str(copy))) == []
    grad = tiny_run.resolved["grad_bytes"]
    steady = tiny_run.buckets[(tiny_run.buckets.step == tiny_run.buckets.step.max()) & (tiny_run.buckets["rank"] == 0)]
    got = _grade(tmp_path, tmp_path, my_bytes_guess=grad, my_buckets_guess=len(steady), my_unhidden_bucket=None)
    assert got["lab01.q1"]["points"] == 2 and got["lab01.q2"]["points"] == 1 and got["lab01.q3"]["points"] == 0
    assert "not answered" in got["lab01.q3"]["feedback"]
    wrong = _grade(tmp_path, tmp_path, my_bytes_guess=grad // 4)
    assert wrong["lab01.q1"]["points"] == 0 and "multiply the parameter count by 4" in wrong["lab01.q1"]["feedback"]
    assert str(grad) not in wrong["lab01.q1"]["feedback"] and f"{grad:,}" not in wrong["lab01.q1"]["feedback"]


def _double_a_bucket(evs):
    next(e for e in evs if e["kind"] == "bucket")["nbytes"] *= 2


def _swap_times(evs):
    b = next(e for e in evs if e["kind"] == "bucket")
    b["t_start"], b["t_end"] = b["t_end"] + 0.01, b["t_start"]


def _slow_forward(evs):
    next(e for e in evs if e["kind"] == "step")["t_fwd"] += 0.5


def _claim_bytes(d):
    doc = json.loads((d / "config.json").read_text())
    doc["resolved"]["grad_bytes"] *= 2
    (d / "config.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("tamper,found", [
    (lambda d: _edit_events(d, 0, _double_a_bucket), "all-reduced"),
    (lambda d: (d / "events" / "rank1.jsonl").unlink(), "ranks [1]"),
    (lambda d: _edit_events(d, 1, _swap_times), "out of order"),
    (lambda d: _edit_events(d, 0, _slow_forward), "do not add up"),
    (lambda d: _edit_events(d, 0, lambda evs: evs.reverse()), "not in time order"),
    (_claim_bytes, "architecture"),
], ids=["bytes", "lost-rank", "bucket-times", "step-parts", "event-order", "claimed-bytes"])
def test_a_tampered_run_is_flagged_and_its_questions_not_graded(copy, tmp_path, tiny_run, tamper, found):
    tamper(copy)
    problems = integrity.run_problems(load_run(str(copy)))
    assert any(found in p for p in problems), problems
    rec = Recordings(tmp_path, False)
    rows = grader.grade_answers(LAB01, {"my_bytes_guess": {"value": tiny_run.resolved["grad_bytes"]}}, rec,
                                str(tmp_path))
    assert all(r["points"] == 0 and r["feedback"].startswith("not graded:") and "inconsistent" in r["feedback"]
               for r in rows), rows
    assert rec.problems and "runs/tiny inconsistent" in rec.problems[0]


def test_a_run_of_another_config_or_an_unfinished_one_is_not_the_labs(copy, tmp_path, tiny_run):
    from dtlab.config.run import tiny
    want = tiny(bucket_mb=1.0, steps=4, baseline_steps=2).to_dict()
    assert any("bucket_mb" in p for p in integrity.run_problems(load_run(str(copy)), want))
    (copy / "status.json").write_text(json.dumps({"state": "failed"}))
    got = _grade(tmp_path, tmp_path, my_bytes_guess=tiny_run.resolved["grad_bytes"])["lab01.q1"]
    assert got["points"] == 0 and "no finished recording matches" in got["feedback"], got


def _calibration(root, drop=None):
    """A hand-made 2-rank calibration: 2 sizes x 3 iterations, slowest-rank timings."""
    d = root / "profiles" / "cal"
    (d / "events").mkdir(parents=True)
    cal = {"nproc": 2, "ops": ["all_reduce"], "sizes": [4096, 1 << 20], "iters": 3, "rounds": 1, "nnodes": 1}
    (d / "config.json").write_text(json.dumps({"calibration": cal, "launch": {"time": 100.0}}))
    (d / "status.json").write_text(json.dumps({"state": "finished"}))
    for r in range(2):
        lines = [{"kind": "start", "rank": r, "time": 101.0}]
        lines += [{"kind": "sample", "rank": r, "op": "all_reduce", "nbytes": n, "nproc": 2, "iter": i,
                   "seconds": 1e-4 * (1 + n / 4096) * (1 + 0.01 * i), "time": 102.0 + k}
                  for k, (n, i) in enumerate((n, i) for n in (4096, 1 << 20) for i in range(3)) if (r, n, i) != drop]
        (d / "events" / f"rank{r}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return d


def test_a_calibration_must_time_every_size_on_every_rank(tmp_path):
    assert integrity.calibration_problems(str(_calibration(tmp_path / "ok"))) == []
    bad = _calibration(tmp_path / "bad", drop=(1, 4096, 2))
    assert any("not every rank timed every iteration" in p for p in integrity.calibration_problems(str(bad)))
    assert any("config differs" in p for p in integrity.calibration_problems(str(bad), {"iters": 10}))


def test_check_cells_are_fingerprinted_and_edits_flagged():
    nb = json.loads((LABS / "01_ddp_breakdown.ipynb").read_text())
    cells = integrity.check_cells(nb)
    assert [c["qids"] for c in cells] == [["lab01.q1", "lab01.q2"], ["lab01.q3"]]
    assert integrity.cell_flags(cells, nb) == []
    i = cells[0]["index"]
    nb["cells"][i]["source"] = "".join(nb["cells"][i]["source"]) + "\n\n   "   # whitespace only: the same cell
    assert integrity.cell_flags(cells, nb) == []
    nb["cells"][i]["source"] = "from dtlab.course.checks import check\ncheck('lab01.q1', 4, run=run)"
    nb["cells"].append({"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                        "source": "for r in _dtlab_answers.values(): r['ok'] = True"})
    flags = integrity.cell_flags(cells, nb)
    assert flags[0] == f"check cell {i + 1} (lab01.q1, lab01.q2) edited or removed", flags
    assert any("is not a distributed cell and uses the checks" in f for f in flags) and len(flags) == 3


def test_the_otter_hidden_test_grades_in_a_process_of_its_own(copy, tmp_path, tiny_run, monkeypatch):
    """dtlab.course.autograde.graded (the masters' hidden tests under otter): the answer variables of the kernel's
    namespace, the key from the runs under the working directory, in a subprocess; records in the namespace are
    ignored."""
    from dtlab.course import autograde
    monkeypatch.chdir(tmp_path)
    grad = tiny_run.resolved["grad_bytes"]
    autograde.graded("lab01.q1", {"my_bytes_guess": grad})
    forged = {"my_bytes_guess": None, "_dtlab_answers": {"lab01.q1": {"ok": True, "points": 2, "max_points": 2}}}
    with pytest.raises(AssertionError, match="not answered yet"):
        autograde.graded("lab01.q1", forged)
    with pytest.raises(AssertionError, match="too low"):
        autograde.graded("lab01.q1", {"my_bytes_guess": grad // 4})


def test_a_students_exception_is_reported_with_its_cell_and_the_rest_still_graded(tmp_path):
    """A small lab 08 notebook (its derived questions need no run) whose second cell raises: the error is named
    with its cell, the cells after it still ran, and a function never defined counts as not answered."""
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("my_factor_guess = 2"),
                nbformat.v4.new_code_cell("my_allreduce_hook = undefined_helper(3)"),
                nbformat.v4.new_code_cell("my_sends_guess = 2\nmy_bytes_guess = '(p - 1) * n'")]
    path = tmp_path / "08_build_it_yourself.ipynb"
    nbformat.write(nb, path)
    res = grader.grade_notebook(str(path), "08_build_it_yourself", cell_timeout_s=120)
    rows = {r["question"]: r for r in res["rows"]}
    assert res["errors"] == ["NameError: name 'undefined_helper' is not defined (cell 2)"] and res["mode"] == "quick"
    assert [rows[q]["points"] for q in ("lab08.q1", "lab08.q2", "lab08.q3")] == [1, 1, 2]
    assert rows["lab08.hook"]["points"] == 0 and "undefined_helper" in rows["lab08.hook"]["feedback"]
    assert "my_allreduce_hook: not defined after the notebook ran" in rows["lab08.hook"]["feedback"]


def test_notebooks_are_matched_to_their_lab_by_option_name_token_or_metadata(tmp_path):
    from dtlab.course.batch import _student_of, lab_of
    known = {"01_ddp_breakdown": {}, "02_collectives_alpha_beta": {}}
    meta = tmp_path / "submission.ipynb"
    meta.write_text(json.dumps({"cells": [], "metadata": {"otter": {"assignment_name": "02_collectives_alpha_beta"}}}))
    plain = tmp_path / "homework.ipynb"
    plain.write_text(json.dumps({"cells": [], "metadata": {}}))
    assert lab_of(str(tmp_path / "01_ddp_breakdown.ipynb"), known) == ("01_ddp_breakdown", "file name")
    assert lab_of(str(tmp_path / "alice_lab02.ipynb"), known)[0] == "02_collectives_alpha_beta"
    assert lab_of(str(tmp_path / "Bob Smith - Lab 1.ipynb"), known)[0] == "01_ddp_breakdown"
    assert lab_of(str(meta), known) == ("02_collectives_alpha_beta", "notebook metadata")
    assert lab_of(str(plain), known, lab="01_ddp_breakdown") == ("01_ddp_breakdown", "--lab")
    lab, why = lab_of(str(plain), known)
    assert lab is None and "cannot tell which lab" in why and "--lab" in why
    assert lab_of(str(plain), known, lab="lab99")[0] is None
    assert _student_of("/x/alice_lab01.ipynb") == "alice" and _student_of("/x/01_ddp_breakdown.ipynb") == \
        "01_ddp_breakdown" and _student_of("/x/carol_01_ddp_breakdown.ipynb") == "carol"
