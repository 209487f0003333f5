"""`dtlab grade`: a batch of submissions graded one notebook at a time, each in a process of its own
(`python -m dtlab.course.grader`), into one CSV that always comes out.

A submission is a notebook, or a directory per student holding notebooks and the `runs/` and `profiles/` they
wrote. A directory (a lone notebook's: its folder) that holds finished recordings is graded from them (replay
mode); otherwise the notebook runs in quick mode. Each notebook is matched to its lab:
by `lab` (the --lab option), its file name (a lab's name, e.g. 01_ddp_breakdown.ipynb, or a token like lab01 in an
LMS download such as alice_lab01.ipynb) or its own metadata (the assignment name `dtlab assign` writes into
every student notebook). A notebook that cannot be read, matched or graded gets error rows with the reason in one
line; the others are graded as usual. The CSV is rewritten after every notebook, so even an interrupted batch
keeps the grades already computed.

Each notebook is graded in a sandbox of its own (dtlab.course.sandbox: bubblewrap, or plain namespaces): its own
copy of its submission, no network, no other file that matters, limits on memory, processes, scratch disk and time;
the CSV's `sandbox` column says which. A limit that is hit is named in the notebook's rows.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from dtlab.course import rubric
from dtlab.course import sandbox as sb
from dtlab.course.limits import Limits, limit_hit, size_text
from dtlab.course.prelab import answers as prelab_answers
from dtlab.course.prelab import prelab_of
from dtlab.course.rubric import LAB_MODULES
from dtlab.launching.replay import recorded_in

COLUMNS = [
    "student",
    "notebook",
    "lab",
    "question",
    "points",
    "max_points",
    "feedback",
    "status",
    "mode",
    "replayed",
    "flags",
    "errors",
    "sandbox",
]


def autograders(path: str) -> dict:
    """{lab: {"zip", "manifest"}} from one autograder zip or `dtlab assign`'s OUT/autograder directory."""
    from dtlab.course.assign import read_manifest

    zips = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.zip")))
    if not zips:
        raise ValueError(f"autograder: no .zip at {path!r} (dtlab assign writes OUT/autograder/<lab>.zip)")
    out = {}
    for z in zips:
        m = read_manifest(z)
        lab = (m or {}).get("lab") or os.path.splitext(os.path.basename(z))[0]
        if lab in LAB_MODULES:
            out[lab] = {"zip": z, "manifest": m}
    if not out:
        raise ValueError(
            f"autograder: none of {[os.path.basename(z) for z in zips]} is the autograder of a dtlab "
            f"lab ({sorted(LAB_MODULES)})"
        )
    return out


def submissions(paths) -> list[tuple[str, str, str]]:
    """(student, notebook, directory) per submitted notebook: a notebook (the student is its name without the
    lab's; its folder is its directory), or a directory of one student's notebooks (the student is its name)."""
    subs = []
    for p in paths:
        if os.path.isdir(p):
            nbs = sorted(glob.glob(os.path.join(p, "*.ipynb")))
            if not nbs:
                raise ValueError(f"submission: no .ipynb in directory {p!r}")
            subs += [(os.path.basename(os.path.normpath(p)), n, p) for n in nbs]
        elif p.endswith(".ipynb") and os.path.isfile(p):
            subs.append((_student_of(p), p, os.path.dirname(os.path.abspath(p))))
        else:
            raise ValueError(f"submission: {p!r} is neither a notebook (.ipynb) nor a directory")
    return subs


def _student_of(path: str) -> str:

    stem = re.sub(r"(?i)[_ .-]?pre-?lab", "", os.path.splitext(os.path.basename(path))[0])  # a pre-lab's too
    for lab in LAB_MODULES:
        stem = stem.replace(lab, "")
    left = re.sub(r"(?i)lab[_ -]?\d+", "", stem).strip("_- .")
    return left or os.path.splitext(os.path.basename(path))[0]


def lab_of(nb_path: str, known, lab: str | None = None) -> tuple[str | None, str]:
    """(the lab of a notebook, or None; how it was found): `lab` when given, else its file name, else its metadata."""

    if lab:
        return (lab, "--lab") if lab in LAB_MODULES else (None, f"--lab {lab!r} is not a lab ({sorted(LAB_MODULES)})")
    stem = os.path.splitext(os.path.basename(nb_path))[0]
    for name in LAB_MODULES:
        if name in stem:
            return name, "file name"
    m = re.search(r"(?i)lab[_ -]?0?(\d)(?!\d)", stem)
    if m:
        return next(n for n in LAB_MODULES if n.startswith(f"0{m.group(1)}_")), "file name"
    try:
        with open(nb_path, encoding="utf-8") as f:
            meta = json.load(f).get("metadata", {})
        name = (meta.get("otter") or {}).get("assignment_name")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in LAB_MODULES:
        return name, "notebook metadata"
    return (
        None,
        f"cannot tell which lab {os.path.basename(nb_path)!r} is (no lab in its name or metadata): "
        f"name it after its lab or pass --lab (labs here: {sorted(known)})",
    )


def _metadata_lab(nb_path: str) -> str | None:
    try:
        with open(nb_path, encoding="utf-8") as f:
            return ((json.load(f).get("metadata") or {}).get("otter") or {}).get("assignment_name")
    except (OSError, ValueError, AttributeError):
        return None


def _has_runs(directory: str | None) -> bool:
    if not directory:
        return False

    return bool(recorded_in(directory))


def _error_rows(lab: str | None, reason: str) -> list[dict]:
    reason = " ".join(str(reason).split())[:600]
    qs = rubric.questions(lab) if lab else []
    base = {"points": 0.0, "feedback": reason, "status": "error", "mode": "", "replayed": 0, "flags": "", "errors": ""}
    return [{**base, "question": q.qid, "max_points": float(q.points)} for q in qs] or [
        {**base, "question": "", "max_points": 0.0}
    ]


def _stop_group(p) -> None:
    """SIGTERM to the worker's process group (the worker shuts its kernel down), SIGKILL after 10 s."""

    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.communicate(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _stage(tmp: str, nb: str, directory: str | None, replay: bool) -> str:
    """The sandbox's read-only inbox: a copy of the notebook and, when replayed, of its directory without any other
    notebook (a folder of lone notebooks holds the other students' too)."""

    inbox = os.path.join(tmp, "in")
    os.makedirs(inbox)
    if replay:
        # links stay links: one pointing at another student's folder points at nothing in the sandbox
        shutil.copytree(
            directory, os.path.join(inbox, "submission"), symlinks=True, ignore=shutil.ignore_patterns("*.ipynb")
        )
    shutil.copy(nb, os.path.join(inbox, os.path.basename(nb)))
    return inbox


class _Reader:
    """Reads the grader's result from the read end of `pipe` on a thread of its own (a result larger than the
    pipe's buffer would otherwise block the grader); the write end is closed here once the grader has it."""

    def __init__(self, pipe: tuple[int, int]):
        os.close(pipe[1])
        self._f, self._chunks = os.fdopen(pipe[0], "rb"), []
        self._t = threading.Thread(target=lambda: self._chunks.append(self._f.read()), daemon=True)
        self._t.start()

    def text(self) -> str:
        self._t.join(timeout=30)
        self._f.close()
        return b"".join(self._chunks).decode("utf-8", "replace")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _grader_command(ag, lab, nb, directory, tmp, timeout_s, boxed, replay, prelab=None):
    """The grader's command line for one notebook (paths as the sandbox sees them when `boxed`), the pipe its result
    comes back through (None unboxed: a file), the output arguments, and the sandbox's in and out boxes."""
    inbox = outbox = None
    if boxed:
        inbox, outbox = _stage(tmp, nb, directory, replay), os.path.join(tmp, "out")
        os.makedirs(outbox)
        os.chmod(tmp, 0o755)
        where = {"nb": f"{sb.IN}/{os.path.basename(nb)}", "sub": f"{sb.IN}/submission", "dir": sb.IN}
        pipe = os.pipe()  # the result comes back through a pipe the kernel cannot reach, not a file it could
        out = ["--out-fd", str(pipe[1])]
    else:
        pipe, where = None, {"nb": os.path.abspath(nb), "sub": os.path.abspath(directory or "."), "dir": tmp}
        out = ["--out", os.path.join(tmp, "result.json")]
    cmd = [
        sys.executable,
        "-m",
        "dtlab.course.grader",
        "notebook",
        where["nb"],
        "--lab",
        lab,
        *out,
        "--cell-timeout",
        str(timeout_s),
    ]
    if ag.get("manifest"):
        cells = os.path.join(inbox if boxed else tmp, "cells.json")
        with open(cells, "w") as f:
            json.dump(ag["manifest"]["check_cells"], f)
        cmd += ["--cells", f"{where['dir']}/cells.json"]
    if prelab:  # read here, never run: its literal answers go to the grader as data
        with open(os.path.join(inbox if boxed else tmp, "prelab.json"), "w") as f:
            json.dump(prelab_answers(prelab), f)
        cmd += ["--prelab-answers", f"{where['dir']}/prelab.json"]
    if replay:
        cmd += ["--submission", where["sub"]]
    return cmd, pipe, out, inbox, outbox


def grade_one(
    ag: dict,
    lab: str,
    nb: str,
    directory: str | None,
    timeout_s: float = 3600.0,
    sandbox: str = "none",
    limits: Limits | None = None,
    prelab: str | None = None,
) -> list[dict]:
    """Grade one notebook in a worker process (in the sandbox `sandbox`: dtlab.course.sandbox, with `limits`, its
    defaults when None); its rows (error rows when the worker failed, naming the limit it hit if it hit one), and
    with `prelab` (the student's pre-lab notebook of the same lab) its rows too, graded against this notebook's runs."""
    limits = limits or Limits()
    replay = _has_runs(directory)
    with tempfile.TemporaryDirectory(prefix="dtlab-batch-") as tmp:
        boxed = sandbox != "none"
        cmd, pipe, out, inbox, outbox = _grader_command(ag, lab, nb, directory, tmp, timeout_s, boxed, replay, prelab)
        # the sandbox is left (the `with`) once none of its processes is left: one left behind could still write
        with (
            sb.prepared(sandbox, cmd, inbox, outbox, limits, pass_fds=(pipe[1],))
            if boxed
            else contextlib.nullcontext((cmd, {}))
        ) as (cmd, kw):
            # a session of its own: a notebook that runs over its time is stopped with its kernel, not left behind
            p = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, start_new_session=True, **kw
            )
            reader = _Reader(pipe) if pipe else None
            try:
                stdout, stderr = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _stop_group(p)
                return _error_rows(lab, f"grading took longer than {timeout_s:.0f} s and was stopped")
        text = reader.text() if reader else _read(out[1])
        if p.returncode != 0 or not text:
            tail = [ln for ln in (stderr or stdout or "").strip().splitlines() if ln.strip()]
            why = f"could not be graded: {tail[-1] if tail else f'exit code {p.returncode}'}"
            hit = limit_hit(why, limits) if boxed else None
            return _error_rows(lab, f"{hit}: {why}" if hit else why)
        try:
            res = json.loads(text)
            flags = list(res["flags"])
            errors = [str(e) for e in res["errors"]]
            rows = [{k: r[k] for k in ("question", "points", "max_points", "feedback")} for r in res["rows"]]
            mode, replayed = res["mode"], res["replayed"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return _error_rows(lab, f"could not be graded: its result could not be read ({type(e).__name__})")
    hit = limit_hit(" ".join(errors), limits) if boxed else None
    if hit:
        flags.append(hit)
    common = {
        "status": "graded",
        "mode": mode,
        "replayed": replayed,
        "flags": " | ".join(flags),
        "errors": " | ".join(errors[:3]),
    }
    return [{**r, **common} for r in rows]


def _alone(prelabs: dict, rows: list, mech: str) -> list[dict]:
    """Error rows for every pre-lab ({(student, lab): path}) whose student handed in no notebook of its lab: a
    pre-lab is graded against the runs of its lab notebook, so it is said, not dropped."""
    graded = {(r["student"], r["lab"]) for r in rows}
    out = []
    for (student, lab), nb in prelabs.items():
        if (student, lab) not in graded:
            why = f"a pre-lab is graded against the runs of its lab notebook: no {lab} notebook from {student}"
            out += [
                {"student": student, "notebook": os.path.basename(nb), "lab": lab, **r, "sandbox": mech}
                for r in _error_rows(lab, why)
            ]
    return out


def grade(
    autograder: str,
    submissions_,
    csv: str | None = None,
    progress: bool = True,
    lab: str | None = None,
    timeout_s: float = 3600.0,
    sandbox: str = "auto",
    memory: int | None = None,
    disk: int | None = None,
    procs: int | None = None,
):
    """Grade `submissions_` (notebooks, or directories of a student's notebooks and runs) with `dtlab assign`'s
    autograders (`autograder`: one zip or the OUT/autograder directory). Returns a DataFrame, one row per student,
    notebook and question (COLUMNS); writes it to `csv` after every notebook. Never stops at a bad notebook.
    `sandbox`: auto (the strongest available here; ValueError when none is), bwrap, namespaces or none (runs the
    students' code with your permissions); `memory`, `disk` (bytes) and `procs`: its limits
    (dtlab.course.sandbox's defaults)."""
    import pandas as pd

    ags = autograders(autograder)
    subs = submissions(submissions_)
    # pre-labs are graded with the lab notebook of the same student and lab, against its runs
    prelabs = {(student, prelab_of(nb)): nb for student, nb, _ in subs if prelab_of(nb)}
    subs = [s for s in subs if not prelab_of(s[1])]
    mech = sb.choose(sandbox)
    if progress:
        limits = Limits.given(memory, disk, procs)
        m, d, n = limits.memory, limits.disk, limits.procs
        print(
            f"dtlab grade: sandbox {mech}"
            + (
                f" (memory {size_text(m)} per process, scratch disk {size_text(d)}, {n} processes, no network)"
                if mech != "none"
                else ": UNSANDBOXED, every submission's code runs with your permissions"
            ),
            flush=True,
        )
    rows = []
    for student, nb, directory in subs:
        found, how = lab_of(nb, ags, lab)
        meta = _metadata_lab(nb)
        if found is None:
            got = _error_rows(None, how)
        elif found not in ags:
            got = _error_rows(found, f"no autograder for {found} in {autograder!r} (have: {sorted(ags)})")
        elif meta and meta != found and how != "--lab":
            got = _error_rows(found, f"its metadata says it is {meta}, its name says {found}: rename it or pass --lab")
        else:
            got = grade_one(
                ags[found],
                found,
                nb,
                directory,
                timeout_s,
                mech,
                Limits.given(memory, disk, procs),
                prelabs.get((student, found)),
            )
        rows += [
            {"student": student, "notebook": os.path.basename(nb), "lab": found or "", **r, "sandbox": mech}
            for r in got
        ]
        df = pd.DataFrame(rows, columns=COLUMNS)
        if csv:
            df.to_csv(csv, index=False)
        if progress:
            pts, mx = sum(r["points"] for r in got), sum(r["max_points"] for r in got)
            state = "error: " + got[0]["feedback"][:120] if got[0]["status"] == "error" else got[0]["mode"]
            print(f"{student} / {os.path.basename(nb)}: {pts:g} of {mx:g} points ({state})", flush=True)
    rows += _alone(prelabs, rows, mech)
    df = pd.DataFrame(rows, columns=COLUMNS)
    if csv:
        df.to_csv(csv, index=False)
    return df
