"""Grade one submitted notebook apart from the student's code (`python -m dtlab.course.grader`).

The notebook runs in a Jupyter kernel of its own (quick mode, or replaying the runs handed in with it), with every
cell run even after an error. All it contributes to the grade is the values of its answer variables (`my_*`:
numbers, strings, None; for lab 8's functions, their source) and the run directories it recorded. This process
then computes every key with the rubric (dtlab.course.rubric) from those recordings, after their consistency
checks (dtlab.course.integrity), and judges each answer (dtlab.course.verdicts). It imported all of that before
the kernel started, and never runs the student's code itself: lab 8's functions run again on ranks of their own.
Nothing the notebook does to the checks, their records or its outputs changes a grade.

`python -m dtlab.course.grader notebook NB --lab LAB [--submission DIR] [--cells JSON] (--out RESULT.json |
--out-fd N)`: execute and grade (what `dtlab grade` runs once per notebook; in a sandbox it reads the result from a
pipe, N, which the notebook's kernel cannot reach: see out_of_reach).
`python -m dtlab.course.grader answers --lab LAB --answers JSON [--qid QID] [--root DIR] --out RESULT.json`:
grade answers exported elsewhere (the otter hidden tests,
dtlab.course.autograde), from the recordings under --root.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import types

from dtlab.course import integrity, recordings, rubric, verdicts

PRELOAD = (
    "dtlab.results.run",
    "dtlab.launching.calibration",
    "dtlab.course.labs",
    "dtlab.config.nodes",
    "dtlab.results.stragglers",
    "dtlab.launching.emulate",
    "dtlab.model.whatif",
    "dtlab.model.costmodel",
    "dtlab.model.compression",
    "dtlab.model.hierarchy",
    "dtlab.model.restarts",
    "dtlab.course.exercises",
    "dtlab.course.checks",
)
# modules a lab 8 function may name (imported for it by the ranks that run it)
ALLOWED_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn",
    "torch.nn.functional",
    "math",
    "time",
    "numpy",
    "functools",
    "itertools",
    "collections",
    "operator",
)

EXPORT_FN = """
def __dtlab_export(ns, path):
    import inspect, json, numbers, types
    out = {}
    for name in sorted(k for k in ns if isinstance(k, str) and k.startswith("my_")):
        v = ns[name]
        try:
            if v is None or v is ... or type(v) in (bool, int, float, str):
                out[name] = {"value": None if v is ... else v}
            elif isinstance(v, numbers.Integral):
                out[name] = {"value": int(v)}
            elif isinstance(v, numbers.Real):
                out[name] = {"value": float(v)}
            elif isinstance(v, types.FunctionType):
                mods = {}
                for n in v.__code__.co_names:
                    m = v.__globals__.get(n)
                    if isinstance(m, types.ModuleType):
                        mods[n] = m.__name__
                out[name] = {"function": v.__name__, "source": inspect.getsource(v), "modules": mods}
            else:
                out[name] = {"other": type(v).__name__}
        except Exception as e:
            out[name] = {"error": type(e).__name__ + ": " + str(e)}
    with open(path, "w") as f:
        json.dump(out, f)
"""


def export_cell(path: str) -> str:
    """The cell appended after the student's cells: the answer variables written to `path` as JSON."""
    return EXPORT_FN + f"__dtlab_export(globals(), {path!r})\n"


def preload() -> None:
    """Import every module a key uses before any student code runs (a later change to the files on disk does not
    reach this process)."""
    for mod in PRELOAD:
        importlib.import_module(mod)
    for lab in rubric.LAB_MODULES:
        rubric.lab_module(lab)


class _Failed:
    """An exercise that could not even start (no source, no def): an ExerciseResult's face."""

    def __init__(self, message: str):
        self.status, self.passed, self.feedback = "error", False, [message]


def _function(spec: dict, scratch: str):
    """A stand-in for the student's function, built from its source without running it here: the def's code
    object and the allowed modules it names. The ranks that check it import its source themselves."""
    src = textwrap.dedent(spec.get("source", ""))
    path = os.path.join(scratch, f"student_{spec.get('function', 'fn')}.py")
    with open(path, "w") as f:
        f.write(src)
    try:
        code = compile(src, path, "exec")
    except SyntaxError as e:
        return _Failed(f"your function's source does not compile: {e}")
    fcode = next(
        (c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == spec.get("function")), None
    )
    if fcode is None:
        return _Failed(f"no `def {spec.get('function')}` in the source of your answer: define it with def")
    g = {"__name__": "student"}
    for name, mod in (spec.get("modules") or {}).items():
        if mod in ALLOWED_MODULES:
            g[name] = importlib.import_module(mod)
    return types.FunctionType(fcode, g, spec["function"])


def answer_of(entry, scratch: str):
    """(value, note): the answer the grader uses for one exported variable, and why it is None when it is."""
    if entry is None:
        return None, "not defined after the notebook ran"
    if "value" in entry:
        v = entry["value"]
        ok = v is None or isinstance(v, (bool, int, float)) or isinstance(v, str)
        return (v[:1000] if isinstance(v, str) else v, "") if ok else (None, "not a number, string or None")
    if "function" in entry:
        return _function(entry, scratch), ""
    if "other" in entry:
        return None, f"a {entry['other']}, not a number, string or None"
    return None, entry.get("error", "could not be read")


def grade_answers(lab: str, exported: dict, rec, scratch: str, errors=(), only: str | None = None) -> list[dict]:
    """One row per question of `lab` (question, points, max_points, feedback, verdict): each answer judged against
    its key computed here from the recordings `rec` (a dtlab.course.recordings.Recordings)."""
    srcs = rubric.lab_module(lab).sources(rec)
    first_error = f"; your notebook raised {errors[0]}" if errors else ""
    rows = []
    for q in rubric.questions(lab):
        if only and q.qid != only:
            continue
        answer, note = answer_of(exported.get(q.var), scratch)
        if isinstance(answer, _Failed) and q.needs and "answer" in q.needs:
            key = verdicts.Key(q.qid, "exercise", answer, points=q.points)
        else:
            try:
                given = {"answer": answer, "scratch": scratch}
                key = rubric.key(q.qid, **{n: given[n] if n in given else srcs[n]() for n in q.needs})
            except recordings.SourceProblem as e:
                rows.append(_row(q, 0.0, f"not graded: {e}", None))
                continue
            except Exception as e:  # noqa: BLE001 - a key that cannot be computed is a row, never a stopped batch
                rows.append(_row(q, 0.0, f"not graded: the key could not be computed ({type(e).__name__}: {e})", None))
                continue
        v = verdicts.judge(key, answer)
        fb = "" if v["ok"] else " | ".join(v["verdict"].splitlines())
        if v["ok"] is None and note:
            fb = f"{q.var}: {note}{first_error} | {fb}"
        if getattr(key, "graded_on", ""):  # a re-run's grade names the run it graded
            fb = " | ".join(x for x in (f"graded against {key.graded_on}", fb) if x)  # first: feedback is cut at 800
        rows.append(_row(q, float(v["points"]), fb, v))
    return rows


def _row(q, points, feedback, v) -> dict:
    return {
        "question": q.qid,
        "points": points,
        "max_points": float(q.points),
        "feedback": feedback[:800],
        "ok": None if v is None else v["ok"],
    }


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FRAME = re.compile(r"\bin ([A-Za-z_][\w.]*)\(")


def _raised_in(traceback: list) -> str | None:
    """The innermost named function of an IPython traceback (its frames read 'File path:line, in name(args)'):
    'Popen._execute_child' for a fork the process limit refused, None for an error at a cell's top level."""
    found = _FRAME.findall(_ANSI.sub("", "\n".join(str(t) for t in traceback)))
    return found[-1] if found else None


def _errors(nb) -> list[str]:
    """'cell N: Name: message' for every cell whose output is an error, in order."""
    out = []
    for i, c in enumerate(nb.cells):
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            if o.get("output_type") == "error":
                msg = " ".join(str(o.get("evalue", "")).split())[:200]
                where = _raised_in(o.get("traceback", []))
                at = f" (raised in {where})" if where else ""
                out.append(f"{o.get('ename', 'Error')}: {msg}{at} (cell {i + 1})")
                break
    return out


def execute(nb_path: str, cwd: str, env: dict, scratch: str, cell_timeout_s: float) -> tuple[dict, list[str]]:
    """Run the notebook in a kernel of its own in `cwd`, every cell even after errors; ({var: exported}, errors)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    nb = nbformat.read(nb_path, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    n_student = len(nb.cells)
    path = os.path.join(scratch, "answers.json")
    nb.cells.append(nbformat.v4.new_code_cell(export_cell(path)))
    client = NotebookClient(
        nb,
        timeout=cell_timeout_s,
        kernel_name="python3",
        allow_errors=True,
        interrupt_on_timeout=True,
        resources={"metadata": {"path": cwd}},
    )
    try:
        client.execute(env=env, cwd=cwd)
    except DeadKernelError as e:
        errs = _errors(nb)
        raise RuntimeError(
            f"the notebook's kernel died ({' '.join(str(e).split())[:200]})" + (f" after {errs[-1]}" if errs else "")
        ) from None
    errors = _errors(nb)
    student_errors = [e for e in errors if not e.endswith(f"(cell {n_student + 1})")]
    if not os.path.exists(path):
        raise RuntimeError(
            "could not read the answers back from the kernel"
            + (f" (the notebook raised {errors[-1]})" if errors else "")
        )
    try:
        with open(path) as f:
            exported = json.load(f)
    except ValueError:  # written in part: the scratch disk filled up under it, say
        raise RuntimeError(
            "could not read the answers back from the kernel"
            + (f" (the notebook raised {errors[-1]})" if errors else "")
        ) from None
    return exported if isinstance(exported, dict) else {}, student_errors


def grade_notebook(
    nb_path: str, lab: str, submission: str | None = None, cells=None, cell_timeout_s: float = 1800.0, prelab=None
) -> dict:
    """Execute and grade one notebook; {"lab", "mode", "replayed", "flags", "errors", "rows"}. `submission`: the
    student's directory when it holds recorded runs (graded from them, replay mode), else None (quick mode);
    `cells`: the distributed check cells (integrity.check_cells of the student version) to compare with; `prelab`:
    the answers of the student's pre-lab (dtlab.course.prelab.answers), judged against the keys of this notebook's
    runs in rows of their own ("lab12.q1 (pre-lab)")."""
    import nbformat

    preload()
    try:
        nb = nbformat.read(nb_path, as_version=4)  # unreadable: stops here, before anything runs
    except Exception as e:  # noqa: BLE001 - json, nbformat and OS errors alike
        raise ValueError(f"unreadable notebook: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(nb.get("cells"), list):
        raise ValueError("unreadable notebook: it has no list of cells")
    flags = integrity.cell_flags(cells, nb) if cells is not None else []
    work = tempfile.mkdtemp(prefix="dtlab-grade-")
    try:
        scratch, root = os.path.join(work, "grader"), os.path.join(work, "nb")  # root: where the notebook runs
        os.makedirs(scratch)
        if submission:  # a copy: the notebook may write (traces, profiles) into what it replays
            shutil.copytree(submission, root, ignore=shutil.ignore_patterns("*.ipynb"))
        os.makedirs(os.path.join(root, "tmp"), exist_ok=True)  # TMPDIR: the setup check's smoke test lands here
        env = {k: v for k, v in os.environ.items() if k not in (recordings.replay.ENV, recordings.replay.LOG_ENV)}
        env.update(HF_HUB_OFFLINE="1", TMPDIR=os.path.join(root, "tmp"))
        if submission:
            env[recordings.replay.ENV] = root
            env.pop("DTLAB_QUICK", None)
        else:
            env["DTLAB_QUICK"] = "1"
        exported, errors = execute(nb_path, root, env, scratch, cell_timeout_s)
        rec = recordings.Recordings(root, replay_mode=bool(submission))
        rows = grade_answers(lab, exported, rec, scratch, errors)
        if prelab is not None:  # the predictions handed in before the lab, against the lab's own runs
            asked = {q.qid for q in rubric.questions(lab) if q.var in prelab}
            pre = grade_answers(lab, prelab, rec, scratch)
            rows += [{**r, "question": f"{r['question']} (pre-lab)"} for r in pre if r["question"] in asked]
        flags += rec.problems
        return {
            "lab": lab,
            "mode": "replay" if submission else "quick",
            "replayed": len(rec.used) if submission else 0,
            "flags": flags,
            "errors": errors,
            "rows": rows,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def without_iri_grammar() -> None:
    """Keep jsonschema from building its RFC 3987 IRI parser in this process. nbformat validates notebooks with
    jsonschema, whose format checkers import rfc3987-syntax when it is installed (jupyter-events requires it), and
    that package builds an Earley grammar at import: about 1.3 CPU-seconds of a grader's 2.7 s start on this
    project's reference machine, for the "iri" and "iri-reference" formats no notebook schema uses. Marking the module
    missing makes jsonschema skip those two checkers, as it does where the package is not installed. A no-op once it
    is imported."""
    sys.modules.setdefault("rfc3987_syntax", None)


def out_of_reach(fd: int) -> None:
    """Keep the result's way out from the notebook's kernel, which runs as this process's user: the descriptor is
    not inherited by the kernel, and this process is made non-dumpable (prctl PR_SET_DUMPABLE 0, proc(5)), so its
    /proc/PID/fd and /proc/PID/mem belong to root and it cannot be ptraced by the same user. Called before the kernel
    starts. Raises OSError where the kernel refuses."""

    os.set_inheritable(fd, False)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4 (linux/prctl.h)
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_DUMPABLE, 0): {os.strerror(err)}")


def main(argv=None) -> int:
    """The command line (see the module's docstring). Writes the result as JSON to --out."""
    without_iri_grammar()  # this process grades one notebook: start it in half the time
    ap = argparse.ArgumentParser(prog="python -m dtlab.course.grader")
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("notebook")
    n.add_argument("notebook")
    n.add_argument("--submission", default=None)
    n.add_argument("--cells", default=None, help="JSON file: the distributed check cells")
    n.add_argument("--cell-timeout", type=float, default=1800.0)
    n.add_argument("--prelab-answers", default=None, help="JSON file: the pre-lab's answers (dtlab.course.prelab)")
    a = sub.add_parser("answers")
    a.add_argument("--answers", required=True)
    a.add_argument("--qid", default=None)
    a.add_argument("--root", default=".")
    a.add_argument("--extra", action="append", default=[], help="another recording directory to consider")
    n.add_argument(
        "--out-fd",
        type=int,
        default=None,
        help="write the result to this inherited descriptor (a pipe) instead of --out",
    )
    n.add_argument("--out", default=None)
    a.add_argument("--out", required=True)
    for p in (n, a):
        p.add_argument("--lab", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "notebook" and (args.out is None) == (args.out_fd is None):
        ap.error("notebook: give one of --out FILE or --out-fd N")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped by dtlab grade: shut the kernel down first
    out_fd = getattr(args, "out_fd", None)
    if out_fd is not None:
        out_of_reach(out_fd)
    if args.cmd == "notebook":
        cells = json.load(open(args.cells)) if args.cells else None
        try:
            prelab = json.load(open(args.prelab_answers)) if args.prelab_answers else None
            result = grade_notebook(args.notebook, args.lab, args.submission, cells, args.cell_timeout, prelab)
        except (ValueError, RuntimeError) as e:  # the one line dtlab grade puts in the error rows
            print(" ".join(str(e).split()), file=sys.stderr)
            return 1
    else:
        preload()
        with open(args.answers) as f:
            exported = json.load(f)
        replaying = bool(os.environ.get(recordings.replay.ENV))
        root = os.environ[recordings.replay.ENV] if replaying else args.root
        scratch = tempfile.mkdtemp(prefix="dtlab-grade-")
        try:
            rec = recordings.Recordings(root, replay_mode=replaying, extra=args.extra)
            result = {"rows": grade_answers(args.lab, exported, rec, scratch, only=args.qid)}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    with os.fdopen(out_fd, "w") if out_fd is not None else open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
