"""The autograder's side, cheaply: keys computed from a recording found by the lab's config, the recording's
consistency checks (each tampering found and named), the check-cell fingerprints, the otter hidden test's
separate process, and a student's exception reported with its cell. Reuses the session's one tiny run
(conftest.tiny_run: the quick-mode lab config) and edits copies of it; one small notebook runs in a kernel."""

import json
import shutil

import pytest

from dtlab.course import grader, integrity
from dtlab.course.recordings import Recordings
from dtlab.results.run import load_run

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
    rows = grader.grade_answers(
        LAB01, {k: {"value": v} for k, v in answers.items()}, Recordings(root, False), str(tmp_path)
    )
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


@pytest.mark.parametrize(
    "tamper,found",
    [
        (lambda d: _edit_events(d, 0, _double_a_bucket), "all-reduced"),
        (lambda d: (d / "events" / "rank1.jsonl").unlink(), "ranks [1]"),
        (lambda d: _edit_events(d, 1, _swap_times), "out of order"),
        (lambda d: _edit_events(d, 0, _slow_forward), "do not add up"),
        (lambda d: _edit_events(d, 0, lambda evs: evs.reverse()), "not in time order"),
        (_claim_bytes, "architecture"),
    ],
    ids=["bytes", "lost-rank", "bucket-times", "step-parts", "event-order", "claimed-bytes"],
)
def test_a_tampered_run_is_flagged_and_its_questions_not_graded(copy, tmp_path, tiny_run, tamper, found):
    tamper(copy)
    problems = integrity.run_problems(load_run(str(copy)))
    assert any(found in p for p in problems), problems
    rec = Recordings(tmp_path, False)
    rows = grader.grade_answers(
        LAB01, {"my_bytes_guess": {"value": tiny_run.resolved["grad_bytes"]}}, rec, str(tmp_path)
    )
    assert all(
        r["points"] == 0 and r["feedback"].startswith("not graded:") and "inconsistent" in r["feedback"] for r in rows
    ), rows
    assert rec.problems and "runs/tiny inconsistent" in rec.problems[0]


def test_a_run_of_another_config_or_an_unfinished_one_is_not_the_labs(copy, tmp_path, tiny_run):
    from dtlab.config.run import tiny

    want = tiny(bucket_mb=1.0, steps=4, baseline_steps=2).to_dict()
    assert any("bucket_mb" in p for p in integrity.run_problems(load_run(str(copy)), want))
    (copy / "status.json").write_text(json.dumps({"state": "failed"}))
    got = _grade(tmp_path, tmp_path, my_bytes_guess=tiny_run.resolved["grad_bytes"])["lab01.q1"]
    assert got["points"] == 0 and "no finished recording matches" in got["feedback"], got


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
