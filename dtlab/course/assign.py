"""Instructor and student versions from one source: `dtlab assign` (grading: dtlab.course.batch, `dtlab grade`).

The labs are authored once, as otter-grader master notebooks in `instructor/` (raw cells `# ASSIGNMENT
CONFIG`, `# BEGIN QUESTION`, `# BEGIN SOLUTION`, `# BEGIN TESTS`). Each graded question is a block whose
solution is the instructor's answer key (a cell between `# BEGIN SOLUTION NO PROMPT` / `# END SOLUTION`
comments, which otter removes from the student version) and whose hidden test is
`dtlab.course.autograde.graded(qid, globals())`: the question graded in a process of its own from the answer
variables and the recorded runs (for `otter run` elsewhere; `dtlab grade` does not run these tests).

`assign(source, out)` runs `otter assign` on every master in `source` and writes `out/student/*.ipynb` (no key,
no tests: what `labs/` holds), `out/prelab/<lab>_prelab.ipynb` (its prediction cells alone, dtlab.course.prelab),
`out/instructor/<lab>.ipynb` (with the keys) and `out/autograder/<lab>.zip`: otter's autograder plus
`dtlab-manifest.json` (the lab, its questions and points, the fingerprints of the distributed check cells, the
versions it was made with) and `DTLAB-README.txt` (what an environment needs to use the zip).

otter-grader is the optional extra `pip install -e ".[course]"`.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import PackageNotFoundError, version

from dtlab import __version__
from dtlab.course import integrity, prelab, rubric

FORBIDDEN = (
    "BEGIN SOLUTION",
    "END SOLUTION",
    "BEGIN TESTS",
    "BEGIN QUESTION",
    "ASSIGNMENT CONFIG",
    "answer key",
    "graded(",
)


def _otter() -> list[str]:
    if importlib.util.find_spec("otter") is None:
        raise RuntimeError(
            'dtlab assign/grade need otter-grader: pip install -e ".[course]" (or pip install otter-grader)'
        )
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


#: Run otter's assign on several masters in one interpreter (otter's imports cost seconds; paid once): argv is
#: a JSON list of [master, result folder]; one JSON line per master with its error, if any, goes to stdout.
_ASSIGN_MANY = """\
import contextlib, io, json, sys, traceback
from otter.assign import main
for master, result in json.loads(sys.argv[1]):
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            main(master, result, no_pdfs=True)
        print(json.dumps({"master": master, "error": None}), flush=True)
    except BaseException as e:
        print(json.dumps({"master": master, "error": f"{type(e).__name__}: {e}",
                          "log": log.getvalue()[-2000:] + traceback.format_exc()[-2000:]}), flush=True)
"""


def assign(source: str, out: str, quiet: bool = True) -> dict:
    """Write student notebooks and autograders for the masters in `source`. Returns {"student": [paths],
    "autograder": [zip paths]}: out/student/<lab>.ipynb, out/autograder/<lab>.zip (with dtlab's manifest), and
    the instructor's solution notebook (keys in, tests out) out/instructor/<lab>.ipynb."""
    _otter()
    result = {"student": [], "autograder": []}
    for d in ("student", "autograder", "instructor", "prelab"):
        os.makedirs(os.path.join(out, d), exist_ok=True)
    found = masters(source)
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(os.path.abspath(m), os.path.join(tmp, os.path.splitext(os.path.basename(m))[0])) for m in found]
        p = subprocess.run([sys.executable, "-c", _ASSIGN_MANY, json.dumps(jobs)], capture_output=True, text=True)
        reports = {}
        for line in p.stdout.splitlines():
            try:
                rec = json.loads(line)
                reports[rec["master"]] = rec
            except (ValueError, KeyError, TypeError):
                if not quiet:
                    print(line)
        for master, res_dir in jobs:
            rec = reports.get(master)
            if rec is None or rec["error"]:
                why = rec["error"] + "\n" + rec.get("log", "") if rec else (p.stdout[-2000:] + p.stderr[-2000:])
                raise RuntimeError(f"otter assign failed on {master}:\n{why}")
            stem = os.path.splitext(os.path.basename(master))[0]
            student = os.path.join(out, "student", f"{stem}.ipynb")
            shutil.copy(os.path.join(res_dir, "student", f"{stem}.ipynb"), student)
            _clean(student, student=True)
            instructor = os.path.join(out, "instructor", f"{stem}.ipynb")
            shutil.copy(os.path.join(res_dir, "autograder", f"{stem}.ipynb"), instructor)
            _clean(instructor, student=False)
            zips = sorted(glob.glob(os.path.join(res_dir, "autograder", "*.zip")))
            zip_path = os.path.join(out, "autograder", f"{stem}.zip")
            shutil.copy(zips[0], zip_path)
            _add_manifest(zip_path, stem, student)
            try:  # the prediction cells alone, handed in before the lab (dtlab.course.prelab)
                prelab.make(student, os.path.join(out, "prelab", f"{stem}_prelab.ipynb"), stem)
            except ValueError:
                pass  # a lab with no graded prediction has no pre-lab
            result["student"].append(student)
            result["autograder"].append(zip_path)
            print(f"{stem}: student {student}, autograder {zip_path}")
    return result


MANIFEST = "dtlab-manifest.json"
ZIP_README = """This otter autograder was written by `dtlab assign` for the lab {lab}.

dtlab grade (recommended): `dtlab grade AUTOGRADER_DIR SUBMISSIONS... --csv scores.csv` in the environment that has
dtlab installed. It does not use otter's results: it runs each notebook in a kernel of its own and computes every key
in a separate process from the recorded runs (see dtlab's docs/course.md for what that does and does not prevent).

otter run / otter grade elsewhere: the hidden tests import dtlab, so the grading environment needs what the labs
need; otter's environment.yml in this zip does NOT install it. Install, in this order:
  pip install torch=={torch} --index-url https://download.pytorch.org/whl/cpu
  pip install "dtlab[course] @ <this dtlab checkout>"     (dtlab {version}{commit}, the one that wrote this zip)
Python {python} wrote it; dtlab needs Python 3.10 or newer. Grading needs no GPU. Gradescope's Docker image built
from environment.yml alone fails on `import dtlab`. Under otter, the hidden tests run inside the student's kernel:
they grade each question in a separate process, but a student who replaces the test function itself in the
kernel passes it. Grades that matter: dtlab grade.
"""


def _commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        p = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return f", commit {p.stdout.strip()}" if p.returncode == 0 and p.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def manifest_for(lab: str, student_nb: str) -> dict:
    """What dtlab grade needs to know about an autograder: the lab, its questions (qid, points, answer variable),
    the distributed check cells' fingerprints, and the versions it was made with."""
    with open(student_nb, encoding="utf-8") as f:
        nb = json.load(f)
    try:  # the installed distribution's version: importing torch here would cost seconds
        torch_version = version("torch").split("+")[0]
    except PackageNotFoundError:
        torch_version = "unknown"
    return {
        "lab": lab,
        "questions": [{"qid": q.qid, "points": q.points, "var": q.var} for q in rubric.questions(lab)],
        "check_cells": integrity.check_cells(nb),
        "dtlab": __version__,
        "commit": _commit().removeprefix(", commit "),
        "torch": torch_version,
        "python": sys.version.split()[0],
    }


def _add_manifest(zip_path: str, lab: str, student_nb: str) -> None:
    m = manifest_for(lab, student_nb)
    with zipfile.ZipFile(zip_path, "a") as z:
        z.writestr(MANIFEST, json.dumps(m, indent=1))
        z.writestr(
            "DTLAB-README.txt",
            ZIP_README.format(
                lab=lab,
                torch=m["torch"],
                version=m["dtlab"],
                commit=f", commit {m['commit']}" if m["commit"] else "",
                python=m["python"],
            ),
        )


def read_manifest(zip_path: str) -> dict | None:
    """The dtlab manifest of an autograder zip, or None (a zip not written by dtlab assign)."""
    try:
        with zipfile.ZipFile(zip_path) as z:
            return json.loads(z.read(MANIFEST)) if MANIFEST in z.namelist() else None
    except (OSError, zipfile.BadZipFile, ValueError, KeyError):
        return None
