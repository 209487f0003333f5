"""Ship a student's function to the ranks and run a check: the launching half of dtlab.course.exercises.

Ranks cannot see notebook globals, so the function's source (`inspect.getsource`) is written into the check's
run directory as RUN_DIR/student.py, after an import line for every module the function names (torch, dist,
math, ...), and config.json records where its `def` is (in student.py and in the notebook cell) so a verdict
can quote the line a rank failed at. The ranks (dtlab.rank.harness) start through dtlab's launcher like any
run, watched by a stall limit of seconds (not the start-up allowance of a training run): a deadlocked ring is
reported as a hang quickly.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import logging
import os
import textwrap
import time
import types

from dtlab.launching.handle import Handle
from dtlab.launching.torchrun import prepare_dir, start_torchrun, unique_dir, write_status
from dtlab.results.events import read_events
from dtlab.results.status import RunFailed
from dtlab.runfiles import dump_json


def not_implemented(fn) -> bool:
    """True when the function's body (after its docstring) is only `raise NotImplementedError(...)`."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if tree.body and hasattr(tree.body[0], "body") else []
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])


def ship(fn, run_dir: str) -> str:
    """Write fn's source as RUN_DIR/student.py, preceded by imports of the modules it names; return the path.
    The function's `def` is on line :func:`def_line` of the file."""
    src = textwrap.dedent(inspect.getsource(fn))
    imports = ["import torch", "import torch.distributed as dist"]
    for name in fn.__code__.co_names:
        val = fn.__globals__.get(name)
        if isinstance(val, types.ModuleType) and name not in ("torch", "dist"):
            imports.append(f"import {val.__name__} as {name}" if val.__name__ != name else f"import {name}")
    path = os.path.join(run_dir, "student.py")
    with open(path, "w") as f:
        f.write(_header(fn.__name__, imports) + src)
    return path


def _header(name: str, imports: list) -> str:
    return f"# {name}, shipped from the notebook by dtlab.course.exercises\n" + "\n".join(imports) + "\n\n\n"


def def_line(run_dir: str, name: str) -> int | None:
    """The line of `def name` in RUN_DIR/student.py (1-based), or None."""
    try:
        with open(os.path.join(run_dir, "student.py")) as f:
            return next((i for i, ln in enumerate(f, 1) if ln.lstrip().startswith(f"def {name}(")), None)
    except OSError:
        return None


class _ExerciseHandle(Handle):
    """A check's ranks: once every rank has recorded anything after `start` (the harness writes `ready`, then
    an event per step, size or timing iteration), `stall_s` seconds of silence is a hang; before that, the
    start-up (importing torch, forming the group) gets the whole timeout."""

    def stall_threshold(self, stepping: bool) -> float:
        started = all(f.last.get("kind") not in (None, "start") for f in self._feeds)
        return self.stall_s if started and self.stall_s else self.timeout_s


def launch_check(kind: str, fn, nproc: int, params: dict, out, timeout_s: float, progress: bool, stall_s: float):
    """Ship `fn` and start the harness ranks for check `kind` with parameters `params` (recorded in config.json,
    and given def_line, cell_line and written_in: where the function's `def` is in student.py and where the
    student wrote it, for the verdict's line numbers);
    returns (events by kind, None or the RunFailed, run dir, notes): notes are what
    the launcher said on stderr while waiting (a rank that crashed in shutdown after every check had finished),
    kept for the verdict instead of a red box under a passing check."""
    if not (stall_s > 0 and timeout_s > 0):
        raise ValueError(f"stall_s and timeout_s must be > 0 seconds, got stall_s={stall_s!r}, timeout_s={timeout_s!r}")
    out = prepare_dir(out or unique_dir("runs", f"exercise-{kind}"))
    ship(fn, out)
    code = fn.__code__
    in_cell = "ipykernel_" in code.co_filename or code.co_filename.startswith("<ipython-input")
    # where the student wrote it: the notebook cell (IPython's cell file) or a module
    params.update(
        def_line=def_line(out, fn.__name__),
        cell_line=code.co_firstlineno,
        written_in="its cell" if in_cell else os.path.basename(code.co_filename),
    )
    dump_json(
        {
            "exercise": {"kind": kind, "name": fn.__name__, "nproc": nproc, **params},
            "launch": {"time": time.time(), "backend": "gloo"},
        },
        os.path.join(out, "config.json"),
    )
    proc = start_torchrun(out, nproc, "dtlab.rank.harness", gloo_threads=True)
    write_status(out, "running", pid=proc.pid, started=time.time())
    handle = _ExerciseHandle(
        out,
        proc,
        nproc,
        1,
        timeout_s,
        f"exercise {kind} x{nproc} (gloo)",
        loader=_events,
        unit="check",
        stall_s=stall_s,
    )
    said, logged = io.StringIO(), _Notes()
    # the launcher's notes come through logging.getLogger("dtlab") (whoever handles it: our console printer, or the
    # program's own logging) and anything else on stderr; a progress bar draws on stderr: keep it there
    logging.getLogger("dtlab").addHandler(logged)
    try:
        with contextlib.redirect_stderr(said) if not progress else contextlib.nullcontext():
            return handle.wait(progress=progress), None, out, _notes(said, logged)
    except RunFailed as e:
        return e.run or {}, e, out, _notes(said, logged)
    finally:
        logging.getLogger("dtlab").removeHandler(logged)


class _Notes(logging.Handler):
    """Keeps the warnings dtlab's launcher logs while an exercise's check waits."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _notes(said: io.StringIO, logged: _Notes) -> list:
    lines = [" ".join(line.split()) for line in logged.lines + said.getvalue().splitlines() if line.strip()]
    return list(dict.fromkeys(lines))  # a logged warning the console printer also wrote to stderr: once


def _events(run_dir: str) -> dict:
    ev = {}
    for name in sorted(os.listdir(os.path.join(run_dir, "events"))):
        for e in read_events(os.path.join(run_dir, "events", name)):
            ev.setdefault(e["kind"], []).append(e)
    return ev
