"""The hidden tests of the otter autograders (`graded("lab01.q1", globals())`): one question graded in a process
of its own (`python -m dtlab.course.grader answers`), from the notebook's answer variables and the run
directories under the working directory (or the replayed submission), never from records or functions the
notebook's kernel holds.

Under `otter run` these tests still run inside the student's kernel, after the student's code: a student who
replaces this very function there passes otter's test. `dtlab grade` does not use otter's results at all (it
runs dtlab.course.grader on each notebook itself); grade with it when grades matter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from dtlab.course.grader import EXPORT_FN
from dtlab.course.rubric import lab_of


def export_answers(env: dict, path: str) -> None:
    """Write the answer variables (`my_*`) of `env` as the grader reads them: numbers, strings, None, and the
    source of functions."""
    ns: dict = {}
    exec(EXPORT_FN, ns)  # the same function the grader appends to a notebook
    ns["__dtlab_export"](env, path)


def _recording_dirs(env: dict) -> list[str]:
    """Directories of recordings the notebook holds outside its working directory (e.g. the smoke test's)."""
    found = []
    for v in env.values():
        for x in v.values() if isinstance(v, dict) else ():
            if isinstance(x, str) and os.path.isfile(os.path.join(x, "config.json")):
                found.append(os.path.abspath(x))
    return sorted(set(found))


def graded(qid: str, env: dict) -> None:
    """Grade `qid` apart from the kernel; raise AssertionError with the verdict when it scored less than full."""
    with tempfile.TemporaryDirectory(prefix="dtlab-autograde-") as d:
        answers, out = os.path.join(d, "answers.json"), os.path.join(d, "result.json")
        export_answers(env, answers)
        cmd = [
            sys.executable,
            "-m",
            "dtlab.course.grader",
            "answers",
            "--lab",
            lab_of(qid),
            "--qid",
            qid,
            "--answers",
            answers,
            "--root",
            os.getcwd(),
            "--out",
            out,
        ]
        for x in _recording_dirs(env):
            cmd += ["--extra", x]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 or not os.path.exists(out):
            raise AssertionError(f"[{qid}] the grader failed: {p.stderr.strip().splitlines()[-1:] or p.returncode}")
        with open(out) as f:
            rows = json.load(f)["rows"]
    if not rows:
        raise AssertionError(f"[{qid}] is not a graded question of {lab_of(qid)}")
    row = rows[0]
    if row["points"] < row["max_points"]:
        raise AssertionError(row["feedback"] or f"[{qid}] not right")
