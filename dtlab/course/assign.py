"""Instructor and student versions from one source, and headless grading: `dtlab assign` and `dtlab grade`.

The labs are authored once, as otter-grader master notebooks in `labs/instructor/` (raw cells `# ASSIGNMENT
CONFIG`, `# BEGIN QUESTION`, `# BEGIN SOLUTION`, `# BEGIN TESTS`). Each graded question is a block whose
solution is the instructor's answer key (a cell between `# BEGIN SOLUTION NO PROMPT` / `# END SOLUTION`
comments, which otter removes from the student version) and whose hidden test is
`dtlab.course.checks.graded(qid)`: it passes when the notebook's own check of that question was right, and
otherwise fails with the check's verdict (expected value, tolerance and its source, hint) as the feedback.

- `assign(source, out)`: runs `otter assign` on every master in `source`; writes `out/student/*.ipynb` (no key,
  no tests: what `labs/` holds), `out/autograder/<lab>.zip` and `out/instructor/<lab>.ipynb` (with the keys).
- `grade(autograder, submissions, csv=...)`: runs `otter run` (no Docker) on each submitted notebook and returns
  one row per student and question: points, max_points, feedback. A submission directory holding the run
  directories its notebook wrote (`runs/`, `profiles/`) is graded from them (DTLAB_REPLAY, see
  dtlab.course.replay): nothing is retrained, whatever machine they came from. Without recorded runs the
  notebook runs in quick mode.

otter-grader is the optional extra `pip install -e ".[course]"`.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from dtlab.course.replay import LOG_ENV

FORBIDDEN = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN TESTS", "BEGIN QUESTION", "ASSIGNMENT CONFIG",
             "answer key", "graded(")


def _otter() -> list[str]:
    try:
        import otter  # noqa: F401
    except ImportError as e:
        raise RuntimeError("dtlab assign/grade need otter-grader: pip install -e \".[course]\" "
                           "(or pip install otter-grader)") from e
    return [sys.executable, "-m", "otter"]


def masters(source: str) -> list[str]:
    """The otter master notebooks in `source` (a file, or a directory of .ipynb)."""
    paths = [source] if os.path.isfile(source) else sorted(glob.glob(os.path.join(source, "*.ipynb")))
    found = [p for p in paths if "# ASSIGNMENT CONFIG" in open(p, encoding="utf-8").read()]
    if not found:
        raise ValueError(f"source: no otter master notebook (a raw cell '# ASSIGNMENT CONFIG') in {source!r}")
    return found


def _clean(path: str, student: bool) -> None:
    """Drop outputs and otter's per-cell test metadata (so that `otter run` checks every question after the
    whole notebook ran, when every check cell has recorded its answer). For the student version also drop the
    empty code cells a removed key leaves, and make sure no key or test text is left."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    meta = nb.get("metadata", {}).pop("otter", {})
    if meta.get("assignment_name"):  # otter run checks that a submission is for its assignment
        nb["metadata"]["otter"] = {"assignment_name": meta["assignment_name"]}
    if student:
        nb["cells"] = [c for c in nb["cells"] if not (c["cell_type"] == "code" and not "".join(c["source"]).strip())]
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
        c.get("metadata", {}).pop("otter", None)
        bad = [w for w in FORBIDDEN if w in "".join(c["source"])] if student else []
        if bad:
            raise RuntimeError(f"{path}: the student version still contains {bad}: check the master's markers")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def assign(source: str, out: str, quiet: bool = True) -> dict:
    """Write student notebooks and autograders for the masters in `source`. Returns {"student": [paths],
    "autograder": [zip paths]}: out/student/<lab>.ipynb, out/autograder/<lab>.zip, and the instructor's
    solution notebook (keys in, tests out) out/instructor/<lab>.ipynb."""
    cmd = _otter()
    result = {"student": [], "autograder": []}
    for d in ("student", "autograder", "instructor"):
        os.makedirs(os.path.join(out, d), exist_ok=True)
    for master in masters(source):
        stem = os.path.splitext(os.path.basename(master))[0]
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.run(cmd + ["assign"] + ([] if quiet else ["-v"]) + [os.path.abspath(master), tmp],
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"otter assign failed on {master}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
            student = os.path.join(out, "student", f"{stem}.ipynb")
            shutil.copy(os.path.join(tmp, "student", f"{stem}.ipynb"), student)
            _clean(student, student=True)
            instructor = os.path.join(out, "instructor", f"{stem}.ipynb")
            shutil.copy(os.path.join(tmp, "autograder", f"{stem}.ipynb"), instructor)
            _clean(instructor, student=False)
            zips = sorted(glob.glob(os.path.join(tmp, "autograder", "*.zip")))
            zip_path = os.path.join(out, "autograder", f"{stem}.zip")
            shutil.copy(zips[0], zip_path)
        result["student"].append(student)
        result["autograder"].append(zip_path)
        print(f"{stem}: student {student}, autograder {zip_path}")
    return result


def _submissions(paths) -> list[tuple[str, str, str]]:
    """(student, notebook, directory) for each submission: a notebook, or a directory of notebooks (the
    student is the directory's name, or the notebook's stem for a lone notebook)."""
    subs = []
    for p in paths:
        if os.path.isdir(p):
            nbs = sorted(n for n in glob.glob(os.path.join(p, "*.ipynb")))
            if not nbs:
                raise ValueError(f"submission: no .ipynb in directory {p!r}")
            subs += [(os.path.basename(os.path.normpath(p)), n, p) for n in nbs]
        elif p.endswith(".ipynb") and os.path.isfile(p):
            subs.append((os.path.splitext(os.path.basename(p))[0], p, os.path.dirname(os.path.abspath(p))))
        else:
            raise ValueError(f"submission: {p!r} is neither a notebook (.ipynb) nor a directory")
    return subs


def _has_runs(directory: str) -> bool:
    for status in sorted(glob.glob(os.path.join(directory, "**", "status.json"), recursive=True)):
        try:
            with open(status) as f:
                if json.load(f).get("state") == "finished":
                    return True
        except (OSError, ValueError):
            continue
    return False


def _feedback(output: str) -> str:
    """The check's verdict from otter's test output (the AssertionError's message), else its last lines."""
    m = re.search(r"AssertionError: (.*)", output, re.S)
    text = m.group(1) if m else output
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " ".join(lines)[:600]


def grade_one(zip_path: str, notebook: str, directory: str, timeout_s: float = 1800.0) -> list[dict]:
    """Grade one notebook with otter run; one dict per question (question, points, max_points, feedback,
    mode, replayed: how many recorded runs and calibrations the notebook loaded). Replays the recorded runs
    in `directory` when it has any, else runs in quick mode; a run the submission lacks is named in the
    feedback of every question that lost points."""
    cmd = _otter()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    replay = _has_runs(directory)
    if replay:
        env["DTLAB_REPLAY"] = os.path.abspath(directory)
    else:
        env["DTLAB_QUICK"] = "1"
        env.pop("DTLAB_REPLAY", None)
    with tempfile.TemporaryDirectory() as tmp:
        log = env[LOG_ENV] = os.path.join(tmp, "replay.jsonl")  # what the notebook really replayed
        p = subprocess.run(cmd + ["run", "--no-logo", "-a", os.path.abspath(zip_path), "-o", tmp,
                                  os.path.abspath(notebook)], capture_output=True, text=True, env=env,
                           timeout=timeout_s, cwd=tmp)
        res = os.path.join(tmp, "results.json")
        if not os.path.exists(res):
            raise RuntimeError(f"otter run wrote no results for {notebook}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
        with open(res) as f:
            tests = json.load(f)["tests"]
        entries = []
        if os.path.exists(log):
            with open(log) as f:
                entries = [json.loads(line) for line in f if line.strip()]
    replayed = sum("run_dir" in e for e in entries)
    missing = " ".join(e["missing"] for e in entries if "missing" in e)
    rows = []
    for t in tests:
        if t.get("max_score") is None:
            continue
        full = t.get("score") == t.get("max_score")
        feedback = "" if full else _feedback(t.get("output", ""))
        if missing and not full:  # the notebook stopped at a run the submission lacks: say that first
            feedback = f"{missing} | {feedback}"
        rows.append({"question": t["name"], "points": float(t.get("score") or 0.0),
                     "max_points": float(t["max_score"]), "feedback": feedback,
                     "mode": "replay" if replay else "quick", "replayed": replayed})
    return rows


def grade(autograder: str, submissions, csv: str | None = None, progress: bool = True):
    """Grade `submissions` (notebooks, or directories of a student's notebooks and runs) with the autograder
    zip(s) in `autograder` (one zip, or `dtlab assign`'s autograder directory: each notebook is graded with the
    zip of the same name). Returns a DataFrame, one row per student, notebook and question; writes it to `csv`."""
    import pandas as pd

    zips = [autograder] if os.path.isfile(autograder) else sorted(glob.glob(os.path.join(autograder, "*.zip")))
    if not zips:
        raise ValueError(f"autograder: no .zip at {autograder!r} (dtlab assign writes OUT/autograder/<lab>.zip)")
    by_stem = {os.path.splitext(os.path.basename(z))[0]: z for z in zips}
    rows = []
    for student, nb, directory in _submissions(submissions):
        stem = os.path.splitext(os.path.basename(nb))[0]
        z = by_stem.get(stem) or (zips[0] if len(zips) == 1 else None)
        if z is None:
            raise ValueError(f"submission {nb!r}: no autograder named {stem}.zip in {autograder!r} "
                             f"(have: {sorted(by_stem)})")
        for r in grade_one(z, nb, directory):
            rows.append({"student": student, "notebook": os.path.basename(nb), **r})
        if progress:
            got = [r for r in rows if r["student"] == student and r["notebook"] == os.path.basename(nb)]
            print(f"{student} / {os.path.basename(nb)}: {sum(r['points'] for r in got):g} of "
                  f"{sum(r['max_points'] for r in got):g} points ({got[0]['mode'] if got else '?'})", flush=True)
    df = pd.DataFrame(rows, columns=["student", "notebook", "question", "points", "max_points", "feedback", "mode",
                                     "replayed"])
    if csv:
        df.to_csv(csv, index=False)
    return df
