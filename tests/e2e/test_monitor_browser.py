"""The live monitor in a real browser: a notebook in JupyterLab (tests/labserver.py) starts a tiny 2-rank run with
`dtlab.run(cfg, watch=True)`; the test reads what plotly drew (`_fullData`) while the run is in flight and sees the
figure grow at least twice, then the final breakdown; and a run whose rank 1 is killed (DTLAB_FAULT) ends with the
monitor showing the failure, the rank named, and RunFailed in the cell.

Needs the Python package `playwright` and Debian's chromium; skipped otherwise. $DTLAB_SCREENSHOTS: a folder for
screenshots of every output once each notebook has run.
"""

from __future__ import annotations

import os
import pathlib
import time

import nbformat
import pytest
from labrun import shared_browser
from labserver import (
    CHROMIUM,
    CHROMIUM_ARGS,
    JS_CELLS,
    JS_COMMAND,
    JS_KERNEL_IDLE,
    LabServer,
    browser_missing,
    open_notebook,
    screenshots,
)

#: a straggler slows each step by 40 ms, so the ranks train for several of the monitor's 2 s redraws
WATCHED = 'run = dtlab.run(dtlab.tiny(out="runs/watched", steps=150, straggler="1:+40ms"), watch=True)'
KILLED = (
    'os.environ["DTLAB_FAULT"] = "1:60:kill"\n'
    'dtlab.run(dtlab.tiny(out="runs/killed", steps=400, straggler="1:+40ms"), watch=True)'
)

KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}

# the monitor as the page shows it: its state, its status line and notes, the figure's title, the T_step trace drawn
JS_MONITOR = """() => {
  const m = document.querySelector('.dtlab-monitor');
  if (!m) return null;
  m.scrollIntoView();
  const st = m.querySelector('.dtlab-monitor-status');
  const plot = m.querySelector('.js-plotly-plot');
  const data = (plot && plot._fullData) ? plot._fullData : [];
  const t = data.find(d => d.name === 'T_step (slowest rank)');
  const end = m.querySelector('.dtlab-monitor-breakdown');
  const notes = Array.from(m.querySelectorAll('.dtlab-monitor-notes li')).map(li => li.textContent);
  return {state: st ? st.dataset.state : null, status: st ? st.textContent : '',
          title: (plot && plot.layout && plot.layout.title && plot.layout.title.text) || '',
          x: t ? Array.from(t.x).map(Number) : [], y: t ? Array.from(t.y).map(Number) : [],
          breakdown: end ? end.textContent : '', notes};
}"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    why = browser_missing()
    if why:
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    root = tmp_path_factory.mktemp("monitor")
    notebooks = root / "notebooks"
    notebooks.mkdir()
    for name, cell in (("watched.ipynb", WATCHED), ("killed.ipynb", KILLED)):
        nb = nbformat.v4.new_notebook(metadata={"kernelspec": KERNEL})
        nb.cells = [nbformat.v4.new_code_cell("import os\nimport dtlab"), nbformat.v4.new_code_cell(cell)]
        nbformat.write(nb, notebooks / name)
    server = LabServer(root / "jupyter", notebooks)
    pw = browser = context = None
    shared = shared_browser()  # a worker that ran a lab already holds Playwright's one instance for this thread
    try:
        server.wait_ready()
        if shared is None:
            pw = sync_playwright().start()
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = (shared or browser).new_context(viewport={"width": 1500, "height": 1000})
        yield context.new_page(), server
    finally:
        for close in (lambda: context.close(), lambda: browser and browser.close(), lambda: pw and pw.stop()):
            try:
                close()
            except Exception:  # noqa: BLE001 - the server must still be stopped
                pass
        server.stop()


def _run_watching(page, url: str, path: str, timeout_s: float = 150.0) -> tuple[list, dict, list]:
    """Run every cell of `path`; until its kernel is idle, record each distinct drawing of the monitor. Returns
    (the drawings seen while the monitor said 'running', the last drawing, the cells' outputs)."""
    open_notebook(page, url, path)
    assert page.evaluate(JS_COMMAND, [path, "notebook:run-all-cells"])
    running, last = [], None
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    page.wait_for_timeout(1000)
    while time.monotonic() < deadline:
        page.wait_for_timeout(250)
        now = page.evaluate(JS_MONITOR)
        if now and now["state"] == "running" and now["x"] and (not running or now["x"] != running[-1]["x"]):
            running.append(now)
        last = now or last
        cells = page.evaluate(JS_CELLS, path)
        ran = all(c["execution_count"] for c in cells if c["type"] == "code")
        if ran and page.evaluate(JS_KERNEL_IDLE, path):
            break
    page.wait_for_timeout(1000)  # the last redraw
    if os.environ.get("DTLAB_SCREENSHOTS"):
        screenshots(page, pathlib.Path(os.environ["DTLAB_SCREENSHOTS"]) / path.removesuffix(".ipynb"))
    print(f"{path}: the monitor was drawn {len(running)} times while running, in {time.monotonic() - t0:.0f} s")
    return running, page.evaluate(JS_MONITOR), page.evaluate(JS_CELLS, path)


def test_the_monitor_updates_while_the_run_is_in_flight(lab):
    page, server = lab
    running, end, cells = _run_watching(page, server.url, "watched.ipynb")
    errors = [o for c in cells for o in c["outputs"] if o.get("output_type") == "error"]
    assert not errors, errors
    # drawn at least twice while the ranks were training, each time with more steps, and the times in ms
    assert len(running) >= 2, f"the monitor was drawn {len(running)} time(s) while running: {running}"
    assert len(running[-1]["x"]) > len(running[0]["x"]) >= 1
    assert all(0 < y < 10_000 for d in running for y in d["y"]), running[-1]["y"]
    assert end["state"] == "finished" and "150 steps of 150" in end["title"], end
    assert len(end["x"]) == 150
    assert "T_step" in end["breakdown"] and "T_comm" in end["breakdown"] and "overlap" in end["breakdown"], end


def test_a_killed_rank_stops_the_monitor_showing_the_failure(lab):
    page, server = lab
    page.evaluate("() => { for (const w of Array.from(window.jupyterapp.shell.widgets('main'))) w.dispose(); }")
    server.shutdown_kernels()
    _, end, cells = _run_watching(page, server.url, "killed.ipynb")
    assert end["state"] == "failed", end
    assert end["notes"][0].startswith("failed: rank 1 (SIGKILL)"), end["notes"]
    assert "failed" in end["status"], end["status"]
    assert "dtlab monitor: failed, 60 steps of 400" in end["title"], end["title"]
    assert not end["breakdown"]  # no breakdown of a run that did not finish
    errors = [o for c in cells for o in c["outputs"] if o.get("output_type") == "error"]
    assert [e["ename"] for e in errors] == ["RunFailed"], errors
