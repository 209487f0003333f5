"""No answer, no reveal: every lab, executed with no answers (tests/labrun.py's run, shared with the other lab
tests), shows no number within a question's tolerance of its key above the question's answer cell or in its check
cell. The keys are computed from the same runs by the rubric, in a process of its own, as `dtlab grade` does
(`python -m dtlab.course.reveal keys`); the scanner itself is tested on hand-made notebooks in
tests/unit/test_reveal.py."""

import json
import os
import subprocess
import sys

import pytest
from labrun import LABS, STUDENT_ANSWERS, drive

from dtlab.course import rubric
from dtlab.course.reveal import scan

#: keys whose recording is not in the lab's folder: lab 0's smoke all-reduce writes to a temporary folder
#: (dtlab.lab.smoke_allreduce), so its two questions' keys cannot be computed from the lab's runs
ELSEWHERE = {"lab00.q1", "lab00.q2"}


def _keys(lab: str, folder, tmp_path) -> dict:
    out = tmp_path / "keys.json"
    env = {**os.environ, "DTLAB_QUICK": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "dtlab.course.reveal", "keys", "--lab", lab, "--root", str(folder), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", LABS)
def test_no_number_key_before_its_answer(name, tmp_path):
    lab = name.removesuffix(".ipynb")
    run = drive(name)
    got = _keys(lab, run.folder, tmp_path)
    problems = {q: why for q, why in got["problems"].items() if q not in ELSEWHERE}
    assert not problems, f"{lab}: keys that could not be computed from its runs: {problems}"
    number_qs = {q.qid for q in rubric.questions(lab)} & set(got["keys"])
    assert set(got["keys"]) == number_qs
    # the inputs a question gives by design were computed from the lab's own runs (lab 6's reference table)
    giving = {q.qid for q in rubric.questions(lab) if q.given is not None} & number_qs
    assert all(got["keys"][q].get("given") for q in giving), {q: got["keys"][q].get("given") for q in giving}
    typed = STUDENT_ANSWERS.get(name, {}).values()  # answered in this run: its checks may show what it earned
    answered = [qid for qid, k in got["keys"].items() if any(line.startswith(k["var"] + " =") for line in typed)]
    found = scan(run.nb, got["keys"], skip_checks=answered)
    assert not found, "\n".join(
        f"{f['qid']}: {f['shown']!r} {f['where']} (cell {f['cell']}) is within the key's tolerance" for f in found
    )
