"""Run each lab once, the way a student does, and keep what it showed: the one place the test suite executes labs.

`drive(name)` runs labs/NAME in quick mode from a temporary copy and returns a `LabRun`: the executed notebook
(read back from disk after JupyterLab saved it), the folder it ran in (its runs/ and profiles/), how long it
took, and, in a real browser, what the page showed: rendered outputs, every slider of every widget moved with
the keyboard (did a figure or label redraw?), a reload of the page (do figures still match the sliders?) and
text that overlaps inside a figure. Results are cached for the whole pytest process, so tests/test_browser.py
(the page) and tests/test_notebooks.py (the outputs) share one execution per lab.

With the Python package `playwright` and Debian's chromium (`apt-get install -y chromium`), labs run in
JupyterLab driven by headless Chromium; otherwise they run headless through nbclient (`browser` is False and
the page checks are skipped). One JupyterLab server, one browser and one page serve every lab (JupyterLab loads
once; each lab closes the last one's documents and opens its own; a lab that fails leaves a fresh page to the
next); all stop when the process exits. $DTLAB_SCREENSHOTS: a folder for screenshots of every lab's outputs
(always taken on failure); $DTLAB_LAB_DIR: run the labs in this (new) folder and keep it, executed notebooks and
runs included.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import nbformat
from labserver import (
    CHROMIUM,
    CHROMIUM_ARGS,
    JS_CLOSE_ALL,
    LabServer,
    browser_missing,
    page_checks,
    run_all,
    screenshots,
)

LABS_DIR = pathlib.Path(__file__).resolve().parent.parent / "labs"
#: every lab, in order; a new lab needs no line here (it only needs its rubric rows in labs/README.md)
LABS = sorted(p.name for p in LABS_DIR.glob("[0-9][0-9]_*.ipynb"))
LAB_TIMEOUT_S = 600  # one lab's run-all in quick mode on a loaded 2-core machine; the slowest takes about 2 min
#: answers a student typed before running, per lab (line prefix -> the line that replaces it): lab 1 gets one
#: right and one wrong answer, so its run also shows how a graded answer is recorded; lab 12 answers its two choice
#: questions, so the scaling table its check cell shows only after an answer is run too (its number questions stay
#: unanswered: tests/e2e/test_no_key.py reads their check cells)
STUDENT_ANSWERS = {
    "01_ddp_breakdown.ipynb": {
        "my_bytes_guess = None": "my_bytes_guess = 4 * n_params",
        "my_buckets_guess = None": "my_buckets_guess = 1000",
    },
    "12_what_does_it_cost.ipynb": {
        "my_cheapest_gpus = None": "my_cheapest_gpus = 1",
        "my_fastest_gpus = None": "my_fastest_gpus = 8",
    },
}
#: the questions those answers answer, per lab
ANSWERED = {"01_ddp_breakdown.ipynb": ("lab01.q1", "lab01.q2"), "12_what_does_it_cost.ipynb": ("lab12.q3", "lab12.q4")}


@dataclass
class LabRun:
    """One execution of a lab: `nb` (the executed notebook), `folder` (where its kernel ran: runs/,
    profiles/), `path` (the executed .ipynb), `seconds` (run-all, kernel start to idle), `browser` (True when a
    real browser ran it), `page` (what the page checks found: problems, moved, reloaded, overlaps, shown)."""

    name: str
    nb: nbformat.NotebookNode
    folder: pathlib.Path
    path: pathlib.Path
    seconds: float
    browser: bool
    page: dict = field(default_factory=dict)


_CACHE: dict = {}
#: where the labs run: $DTLAB_LAB_DIR (kept afterwards, to read the executed notebooks) or a temporary folder
_KEEP = bool(os.environ.get("DTLAB_LAB_DIR"))
_ROOT = pathlib.Path(os.environ["DTLAB_LAB_DIR"]) if _KEEP else pathlib.Path(tempfile.mkdtemp(prefix="dtlab-labs-"))
_SESSION: dict = {}
_FAILED: list = []  # labs whose run failed: their folder is kept for a look


def _edit_answers(nb, answers: dict) -> None:
    """Put a student's answers into the lab: `answers` maps a line prefix ('my_bytes_guess = None') to the
    line that replaces it."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            for old, new in answers.items():
                if old in cell.source:
                    cell.source = cell.source.replace(old, new)


def drive(name: str) -> LabRun:
    """Execute lab `name` once per process (later calls return the same LabRun), with the answers of
    :data:`STUDENT_ANSWERS` typed in: in the browser when one is available, else headless."""
    if name in _CACHE:
        return _CACHE[name]
    folder = _ROOT / name.removesuffix(".ipynb")
    folder.mkdir(parents=True, exist_ok=not _KEEP)
    nb = nbformat.read(LABS_DIR / name, as_version=4)
    _edit_answers(nb, STUDENT_ANSWERS.get(name, {}))
    path = folder / name
    nbformat.write(nb, path)
    why = browser_missing()
    t0 = time.monotonic()
    if why is None:
        run = _in_browser(name, folder, path)
    else:
        _headless(path, folder)
        run = LabRun(
            name, nbformat.read(path, as_version=4), folder, path, time.monotonic() - t0, False, {"skipped": why}
        )
    _CACHE[name] = run
    print(
        f"{name}: ran in {run.seconds:.0f} s ({'browser' if run.browser else 'headless'}), page checks "
        f"{run.page.get('check_s', 0):.0f} s, {time.monotonic() - t0:.0f} s in all"
    )
    return run


def _headless(path: pathlib.Path, folder: pathlib.Path) -> None:
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = {"DTLAB_QUICK": "1", "HF_HUB_OFFLINE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(
            nb,
            timeout=LAB_TIMEOUT_S,
            kernel_name="python3",
            allow_errors=True,
            resources={"metadata": {"path": str(folder)}},
        ).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    nbformat.write(nb, path)


def _session():
    """The shared JupyterLab server (rooted at the temporary folder), headless Chromium and the page the labs run
    in, one after another (JupyterLab loads once; see labserver.open_notebook)."""
    if not _SESSION:
        from playwright.sync_api import sync_playwright

        server = LabServer(_ROOT / ".jupyter", _ROOT)
        server.wait_ready()
        pw = sync_playwright().start()
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        _SESSION.update(server=server, pw=pw, browser=browser)
        atexit.register(_close)
    if "page" not in _SESSION:
        context = _SESSION["browser"].new_context(viewport={"width": 1500, "height": 1000})
        page = context.new_page()
        errors: list[str] = []
        console: list[str] = []  # kept for the report: JupyterLab logs harmless errors there too
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
        _SESSION.update(context=context, page=page, errors=errors, console=console)
    return _SESSION


def shared_browser():
    """The Chromium this process's lab runs use, or None before any lab ran here. Playwright's sync API allows one
    running instance per thread: another browser test in the same worker must open its pages in this one."""
    return _SESSION.get("browser")


def _new_page() -> None:
    """Drop the lab page (after a failure: whatever state it was left in), so the next lab gets a fresh one."""
    context = _SESSION.pop("context", None)
    for key in ("page", "errors", "console"):
        _SESSION.pop(key, None)
    if context is not None:
        try:
            context.close()
        except Exception as e:  # noqa: BLE001 - a broken page must not stop the next lab
            print(f"closing the lab page: {e}")


def _close() -> None:
    _new_page()
    s = dict(_SESSION)
    _SESSION.clear()
    for step in (lambda: s["browser"].close(), lambda: s["pw"].stop(), lambda: s["server"].stop()):
        try:
            step()
        except Exception as e:  # noqa: BLE001 - closing must go on to the server
            print(f"closing the lab session: {e}")
    if _FAILED or _KEEP:
        print(f"the labs ran in {_ROOT} (kept)")
    else:
        shutil.rmtree(_ROOT, ignore_errors=True)


def _in_browser(name: str, folder: pathlib.Path, path: pathlib.Path) -> LabRun:
    s = _session()
    page, errors, console = s["page"], s["errors"], s["console"]
    errors.clear()
    console.clear()
    shots = os.environ.get("DTLAB_SCREENSHOTS")
    ok = False
    try:
        rel = path.relative_to(_ROOT).as_posix()
        seconds = run_all(page, s["server"].url, rel, LAB_TIMEOUT_S)  # run and saved
        t_checks = time.monotonic()
        report = page_checks(page, rel)
        report["check_s"] = time.monotonic() - t_checks
        report["page_errors"], report["console_errors"] = list(errors), list(console)
        if shots:
            screenshots(page, pathlib.Path(shots) / name.removesuffix(".ipynb"))
        closed = page.evaluate(JS_CLOSE_ALL)  # this lab's documents are closed before its kernel goes
        page.wait_for_timeout(200)  # events of its teardown arrive now, and the next lab's start clears them
        ok = True
        if not closed:
            _new_page()
    finally:
        if not ok:
            _FAILED.append(name)
            folder_shots = pathlib.Path(shots or folder) / ("screenshots-" + name.removesuffix(".ipynb"))
            screenshots(page, folder_shots)
            print(f"{name}: screenshots of the failure in {folder_shots}\n{s['server'].log_tail()}")
            _new_page()  # the next lab starts on a fresh page
        s["server"].shutdown_kernels()  # this lab's kernel: the next lab starts its own
    nb = nbformat.read(path, as_version=4)
    return LabRun(name, nb, folder, path, seconds, True, report)


def outputs_text(nb) -> str:
    """Every text output of an executed notebook (streams, plain text of results and displays, errors)."""
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            text = o.get("text", "") or o.get("data", {}).get("text/plain", "")
            out.append("".join(text) if isinstance(text, list) else str(text))
            if o.get("output_type") == "error":
                out.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "\n".join(out)


def error_outputs(nb) -> list:
    """'cell i: Name: value' for every error output, and every stderr text that is not a progress bar."""
    import re

    bar = re.compile(r"^\s*$|\d+%\||\|\s*\d+/\d+|\[[\d:<?, .a-z/]*\]")
    bad = []
    for i, c in enumerate(nb.cells):
        for o in c.get("outputs", []):
            if o.get("output_type") == "error":
                bad.append(f"cell {i}: {o.get('ename')}: {o.get('evalue')}")
            elif o.get("output_type") == "stream" and o.get("name") == "stderr":
                text = "".join(o["text"]) if isinstance(o["text"], list) else o["text"]
                lines = [ln for ln in text.replace("\r", "\n").splitlines() if not bar.search(ln)]
                if lines:
                    bad.append(f"cell {i}: stderr: {' | '.join(lines)[:500]}")
    return bad


def as_json(nb) -> dict:
    return json.loads(nbformat.writes(nb))
