"""The labs' graded questions: for each, its points, the student's answer variable, and the function that computes
its key (dtlab.course.verdicts.Key) from the objects the lab holds: a run, a profile, a sweep, ...

One module per lab (`lab00`, `lab01`, ...). Each defines `LAB` (the notebook's name), `QUESTIONS` (a tuple of
`Question`) and `sources(rec)`: where the autograder finds each source among a submission's recordings
(`rec`, a dtlab.course.recordings.Recordings), as {name: a function that loads it}. The same key functions run
in the notebook (`dtlab.course.checks.check(qid, answer, run=run)`, formative) and in the autograder's own
process (dtlab.course.grader), so the notebook shows the verdict the grade gives, and the grade never depends on
code the student's kernel could change. The configs each `sources` asks for are the lab's own (the notebook's
`lab_config(...)`, sizes and iterations): a change there must be mirrored here, or the autograder reports the
recording as missing, naming the fields that differ.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from dtlab.units import fmt_time

LAB_MODULES = {
    "00_setup_check": "lab00",
    "01_ddp_breakdown": "lab01",
    "02_collectives_alpha_beta": "lab02",
    "03_buckets_and_gpu_count": "lab03",
    "04_zero3_vs_ddp": "lab04",
    "05_shrinking_comm": "lab05",
    "06_stragglers_ps_faults": "lab06",
    "07_beyond_one_machine": "lab07",
    "08_build_it_yourself": "lab08",
    "09_does_it_still_learn": "lab09",
    "10_tensor_and_pipeline": "lab10",
    "11_reading_a_trace": "lab11",
    "12_what_does_it_cost": "lab12",
}


@dataclass(frozen=True)
class Question:
    """A graded question: `qid`, `points`, the answer variable `var` (`my_*`), the sources its key needs (names
    of `key`'s arguments; the autograder also offers `answer`, the student's value, and `scratch`, a directory
    for runs of its own) and `key(**sources) -> Key`. A lab shows some numbers above a question by design that are
    no reading of its key: a prediction's inputs (near the measured key when the model was right), or another
    quantity of the key's unit that the key does not come from. `given(**sources)` (of the sources in
    `given_needs`, recorded before the answer cell) returns those numbers in the key's unit, so that the scan for
    a key shown before its question (dtlab.course.reveal) does not take one of them for the key."""

    qid: str
    points: int
    var: str
    needs: tuple
    key: Callable
    given: Callable | None = None
    given_needs: tuple = ()


def graded_run(run, what: str = "run") -> str:
    """What a key was computed from, as the grader says it beside the grade: the run directory's name and its
    T_step with the 90% interval (run.summary()), so a grade from a re-run names the run it graded."""
    t = run.summary().set_index("quantity").loc["T_step"]
    iv = f", 90% interval {fmt_time(t['lo'])} .. {fmt_time(t['hi'])}" if t["lo"] == t["lo"] else ""
    return f"{what} {os.path.basename(str(run.path).rstrip('/'))} (T_step {fmt_time(t['value'])}{iv})"


def t_step_spread(run) -> tuple[float, str]:
    """(relative half-width of the run's T_step interval, its words): the tolerance of a key that scales with T_step,
    from the run's own spread (run.summary()'s 90% interval of the median over measured steps)."""
    t = run.summary().set_index("quantity").loc["T_step"]
    if not (t["lo"] == t["lo"] and t["hi"] == t["hi"] and t["value"] > 0):
        return 0.0, "the run recorded no interval of T_step"
    rel = (float(t["hi"]) - float(t["lo"])) / 2 / float(t["value"])
    return (
        rel,
        f"half the 90% interval of this run's T_step ({fmt_time(t['lo'])} .. {fmt_time(t['hi'])}) over its median",
    )


def lab_module(lab: str):
    """The rubric module of a lab (its notebook's name, e.g. "01_ddp_breakdown", or its module, "lab01")."""
    mod = LAB_MODULES.get(lab, lab if lab in LAB_MODULES.values() else None)
    if mod is None:
        raise ValueError(f"lab: unknown lab {lab!r}; known: {sorted(LAB_MODULES)}")
    return importlib.import_module(f"dtlab.course.rubric.{mod}")


def questions(lab: str) -> tuple:
    """The graded questions of a lab, in notebook order."""
    return lab_module(lab).QUESTIONS


def lab_of(qid: str) -> str:
    """The lab (notebook name) a qid belongs to: "lab01.q1" -> "01_ddp_breakdown"."""
    num = qid.split(".")[0].removeprefix("lab")
    for lab in LAB_MODULES:
        if lab.startswith(num + "_"):
            return lab
    raise ValueError(f"qid: {qid!r} names no lab (qids look like lab01.q1; labs: {sorted(LAB_MODULES)})")


def question(qid: str) -> Question:
    """The Question with this qid."""
    for q in questions(lab_of(qid)):
        if q.qid == qid:
            return q
    raise ValueError(
        f"qid: {qid!r} is not a graded question of {lab_of(qid)} "
        f"(its questions: {[q.qid for q in questions(lab_of(qid))]})"
    )


def key(qid: str, **sources):
    """The Key of `qid` from `sources` (only the ones its question needs are used; a missing one raises
    ValueError naming it)."""
    q = question(qid)
    missing = [n for n in q.needs if n not in sources]
    if missing:
        raise ValueError(f"{qid}: its key needs {', '.join(missing)} (pass {', '.join(f'{n}=...' for n in missing)})")
    k = q.key(**{n: sources[n] for n in q.needs})
    if k.points != q.points or k.qid != qid:
        raise RuntimeError(f"{qid}: the rubric's key says {k.qid} for {k.points} points, the question {q.points}")
    return k
