"""JupyterLab and headless Chromium for the lab tests (tests/labrun.py): the server, running every cell, and what
the page shows (widgets that redraw when moved, figures that survive a reload, text that overlaps in a figure).

The server runs with its own config, data, runtime and settings folders; every cell in the DOM (no windowing)
and no news or update toasts. Needs the Python package `playwright` and Debian's chromium (Playwright's own
browser download is not used): `browser_missing()` says why not when either is absent.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

CHROMIUM = os.environ.get("DTLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}
#: how long one arrow key may take to move a slider's readout (the browser handles it at once on a quiet machine)
STEP_WAIT_S = 5.0
REDRAW_WAIT_S = 20.0  # a slider move's redraw (model + figure update) on a loaded machine takes well under this
BAD_RENDER = ("Error displaying widget", "Error rendering output", "Traceback", "model not found")


def browser_missing() -> str | None:
    """Why the lab tests cannot use a real browser here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed (pip install playwright)"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or set DTLAB_CHROMIUM)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


class LabServer:
    """`jupyter lab` on a free loopback port, no token, serving `notebooks`, everything it writes under `root`."""

    def __init__(self, root: pathlib.Path, notebooks: pathlib.Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.log_path = root / "jupyterlab.log"
        env = dict(os.environ, DTLAB_QUICK="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        for var, sub in (
            ("JUPYTER_CONFIG_DIR", "config"),
            ("JUPYTER_DATA_DIR", "data"),
            ("JUPYTER_RUNTIME_DIR", "runtime"),
            ("IPYTHONDIR", "ipython"),
        ):
            env[var] = str(root / sub)
            (root / sub).mkdir(parents=True, exist_ok=True)
        env.pop("JUPYTER_PATH", None)
        settings = root / "settings"
        for name, value in LAB_SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        self.port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            f"--port={self.port}",
            "--ip=127.0.0.1",
            "--ServerApp.port_retries=0",
            "--IdentityProvider.token=",
            "--ServerApp.password=",
            f"--ServerApp.root_dir={notebooks}",
            f"--LabApp.user_settings_dir={settings}",
            f"--LabApp.workspaces_dir={root / 'workspaces'}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=",
            "--ServerApp.open_browser=False",
            "--ServerApp.disable_check_xsrf=True",
        ]  # loopback only, no token: the REST calls below need no xsrf
        if os.geteuid() == 0:  # CI containers run as root
            cmd.append("--allow-root")
        self._log = open(self.log_path, "w")
        # its own session: stop() signals the server alone, by its pid, and the kernels through the REST API
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=notebooks, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                _get(f"{self.url}/api/status", timeout=2)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        raise RuntimeError(f"jupyter lab did not answer within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def shutdown_kernels(self) -> None:
        """Shut every kernel down through the REST API (each lab's kernel after its checks)."""
        try:
            for k in _get(f"{self.url}/api/kernels", timeout=3) or []:
                req = urllib.request.Request(f"{self.url}/api/kernels/{k['id']}", method="DELETE")
                urllib.request.urlopen(req, timeout=20).close()
        except (urllib.error.URLError, OSError, ValueError):
            pass

    def stop(self) -> None:
        self.shutdown_kernels()  # so no kernel outlives the server
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


# ------------------------------------------------------------------ the page (JupyterLab's own model)

# the notebook panel of one path (not the "current" widget: a restored workspace may hold other tabs)
JS_PANEL = """(path) => { const app = window.jupyterapp; if (!app) return null;
  for (const w of app.shell.widgets('main')) if (w.context && w.context.path === path) return w;
  return null; }"""

JS_CELLS = (
    """(path) => {
  const nb = ("""
    + JS_PANEL
    + """)(path);
  if (!nb || !nb.content || !nb.content.widgets) return null;
  return nb.content.widgets.map((c, i) => {
    const m = c.model, out = [];
    if (m.type === 'code') {
      for (let j = 0; j < m.outputs.length; j++) out.push(m.outputs.get(j).toJSON());
    }
    return {index: i, type: m.type, execution_count: m.type === 'code' ? m.executionCount : null, outputs: out};
  });
}"""
)

JS_KERNEL_IDLE = (
    """(path) => { const nb = ("""
    + JS_PANEL
    + """)(path);
  const k = nb && nb.sessionContext && nb.sessionContext.session && nb.sessionContext.session.kernel;
  return !!k && k.status === 'idle'; }"""
)

# commands are fired, never awaited: a command's promise may wait on a dialog or on every cell
JS_COMMAND = (
    """([path, command]) => { const app = window.jupyterapp, nb = ("""
    + JS_PANEL
    + """)(path);
  if (!nb) return false; app.shell.activateById(nb.id); app.commands.execute(command); return true; }"""
)

JS_DIRTY = """(path) => { const nb = (""" + JS_PANEL + """)(path); return !nb || nb.context.model.dirty; }"""

JS_FIGURE = """(el) => ({
  title: (el.querySelector('.gtitle') || {}).textContent || '',
  data: (el.data || []).map(t => ({name: t.name, x: Array.from(t.x || []).map(String),
                                   y: Array.from(t.y || []).map(Number)})),
})"""

# every explorer on the page: an output holding sliders, its visible sliders, its figures and its labels
JS_WIDGET_STATE = """(i) => {
  const outs = Array.from(document.querySelectorAll('.jp-OutputArea-output'))
      .filter(o => o.querySelector('.widget-slider'));
  const o = outs[i];
  if (!o) return null;
  const fig = el => ({title: (el.layout && el.layout.title && el.layout.title.text)
                             || (el.querySelector('.gtitle') || {}).textContent || '',
      // the traces as plotly drew them (_fullData): an array that came as a typed-array spec ({dtype, bdata}, how
      // plotly's JSON carries numbers) is decoded there, not in el.data
      data: ((el._fullData && el._fullData.length) ? el._fullData : (el.data || [])).map(t => ({
          x: Array.from(t.x || []).map(String), y: Array.from(t.y || []).map(Number),
          marker: JSON.stringify({color: (t.marker || {}).color, symbol: (t.marker || {}).symbol})}))});
  const sliders = Array.from(o.querySelectorAll('.widget-slider')).filter(s => s.offsetParent !== null);
  return {figures: Array.from(o.querySelectorAll('.js-plotly-plot')).map(fig),
          sliders: sliders.map(s => ({label: (s.querySelector('.widget-label') || {}).textContent || '',
                                      readout: (s.querySelector('.widget-readout') || {}).textContent || ''})),
          labels: Array.from(o.querySelectorAll('.widget-html')).map(h => h.textContent)};
}"""

# pairs of text boxes that overlap inside each figure: titles, axis titles, annotations (subplot titles too), legend
JS_OVERLAPS = """() => {
  const out = [];
  document.querySelectorAll('.js-plotly-plot').forEach((plot, p) => {
    const title = (plot.querySelector('.gtitle') || {}).textContent || `figure ${p}`;
    const items = [];
    const add = (sel, kind) => plot.querySelectorAll(sel).forEach(el => {
      const r = el.getBoundingClientRect();
      if (r.width > 0 && r.height > 0) items.push({kind, text: (el.textContent || '').slice(0, 60), r});
    });
    add('.gtitle', 'title'); add('.g-xtitle text, .g-x2title text, .g-x3title text', 'x title');
    add('.g-ytitle text, .g-y2title text, .g-y3title text', 'y title');
    add('.annotation-text-g', 'annotation'); add('.legend .bg', 'legend');
    for (let a = 0; a < items.length; a++) for (let b = a + 1; b < items.length; b++) {
      const A = items[a].r, B = items[b].r;
      const w = Math.min(A.right, B.right) - Math.max(A.left, B.left);
      const h = Math.min(A.bottom, B.bottom) - Math.max(A.top, B.top);
      if (w > 2 && h > 2) out.push(`${title.slice(0, 60)}: ${items[a].kind} '${items[a].text}' overlaps `
                                   + `${items[b].kind} '${items[b].text}' (${Math.round(w)} x ${Math.round(h)} px)`);
    }
  });
  return out;
}"""


# where the keyboard's focus is and what could have taken it (a dialog traps the focus; a disabled slider ignores keys)
JS_FOCUS = """() => { const a = document.activeElement;
  const d = Array.from(document.querySelectorAll('.jp-Dialog')).map(x => x.textContent.trim().slice(0, 160));
  const cls = a && typeof a.className === 'string' ? a.className.trim().split(/\\s+/).join('.') : '';
  const off = document.querySelectorAll('.widget-slider [disabled], .noUi-target[disabled]').length;
  return `focus on ${a ? a.tagName.toLowerCase() + (cls ? '.' + cls : '') : 'nothing'}`
         + (d.length ? `; dialog: ${d.join(' | ')}` : '; no dialog')
         + `; disabled sliders: ${off}; page has focus: ${document.hasFocus()}`; }"""


# every document in the main area closed at once, without a dialog (run-all saved the notebook; what the page
# checks changed afterwards is not kept), so the page holds one lab at a time
JS_CLOSE_ALL = """() => { const app = window.jupyterapp; if (!app) return false;
  for (const w of Array.from(app.shell.widgets('main'))) w.dispose();
  return Array.from(app.shell.widgets('main')).length === 0; }"""

JS_OPEN = """(path) => { window.jupyterapp.commands.execute('docmanager:open', {path}); return true; }"""

JS_HAS_CELLS = (
    """(path) => { const nb = ("""
    + JS_PANEL
    + """)(path);
  return !!(nb && nb.content && nb.content.widgets && nb.content.widgets.length); }"""
)


def open_notebook(page, url: str, path: str) -> None:
    """Open notebook `path` (relative to the server's root) with its kernel started and idle. JupyterLab is loaded
    once per page (`url`/lab?reset: no tabs restored); a page that already runs it opens the next notebook in place,
    which saves loading JupyterLab again for every lab. The caller closes the last lab's documents (JS_CLOSE_ALL)
    before its kernel goes, so the notebook is the page's only document (JupyterLab's launcher may reappear)."""
    page.set_viewport_size({"width": 1500, "height": 1000})  # screenshots of the last lab may have changed it
    if not page.evaluate("() => !!(window.jupyterapp && window.jupyterapp.shell)"):
        page.goto(url + "/lab?reset", wait_until="domcontentloaded", timeout=90_000)
        page.wait_for_function("() => !!(window.jupyterapp && window.jupyterapp.shell)", timeout=90_000)
        page.evaluate("() => window.jupyterapp.restored")  # the (reset) workspace is in place
    page.evaluate(JS_OPEN, path)
    page.wait_for_function(JS_HAS_CELLS, arg=path, timeout=90_000)
    page.wait_for_function(JS_KERNEL_IDLE, arg=path, timeout=120_000)


def run_all(page, url: str, path: str, timeout_s: float) -> float:
    """Open the notebook `path` (relative to the server's root) at `url` (see `open_notebook`), run every cell,
    wait until all ran (or one raised) and its kernel is idle, save it; returns the seconds from run-all to
    idle."""
    open_notebook(page, url, path)
    n_code = sum(c["type"] == "code" for c in page.evaluate(JS_CELLS, path))
    t0 = time.monotonic()
    assert page.evaluate(JS_COMMAND, [path, "notebook:run-all-cells"]), f"{path} is not open"
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        page.wait_for_timeout(250)
        cells = page.evaluate(JS_CELLS, path)
        code = [c for c in cells if c["type"] == "code"]
        if any(o.get("output_type") == "error" for c in code for o in c["outputs"]):
            break  # run-all stops at an error: the test reports it from the saved notebook
        if len(code) == n_code and all(c["execution_count"] for c in code) and page.evaluate(JS_KERNEL_IDLE, path):
            break
    else:
        pending = [c["index"] for c in cells if c["type"] == "code" and not c["execution_count"]]
        raise TimeoutError(f"cells {pending} had not run after {timeout_s} s")
    seconds = time.monotonic() - t0
    page.wait_for_timeout(500)  # let the last outputs render
    page.evaluate(JS_COMMAND, [path, "docmanager:save"])
    page.wait_for_function(f"() => !({JS_DIRTY})({json.dumps(path)})", timeout=60_000)
    return seconds


def _widget_count(page) -> int:
    return page.evaluate("""() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
                                 .filter(o => o.querySelector('.widget-slider')).length""")


def _settle(page, w: int, path: str, timeout_s: float = 30.0) -> dict:
    """Widget `w`'s state once it stops changing and the kernel is idle: a slider moved three steps sends three
    changes, and their redraws arrive one after another."""
    deadline = time.monotonic() + timeout_s
    last = page.evaluate(JS_WIDGET_STATE, w)
    while time.monotonic() < deadline:
        page.wait_for_timeout(300)
        now = page.evaluate(JS_WIDGET_STATE, w)
        drawn = all(f["title"] and f["data"] for f in now["figures"])  # not between a purge and a redraw
        if now == last and drawn and page.evaluate(JS_KERNEL_IDLE, path):
            return now
        last = now
    return last


#: how long a figure may take to be drawn once scrolled into view (under a second on a quiet machine); one not drawn
#: by then is reported as such: plotly FigureWidgets under load stayed blank until a reload, and each slider move
#: would otherwise be reported as changing nothing
DRAW_WAIT_S = 120


def _show_figures(page, w: int) -> list:
    """Scroll every figure of widget `w` into view once and wait until plotly has drawn each (at most
    DRAW_WAIT_S for all); returns the indexes of the figures still not drawn."""
    out = page.locator(".jp-OutputArea-output", has=page.locator(".widget-slider")).nth(w)
    plots = out.locator(".js-plotly-plot")
    deadline = time.monotonic() + DRAW_WAIT_S
    undrawn = []
    for i in range(plots.count()):
        plots.nth(i).scroll_into_view_if_needed()
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        drawn = plots.nth(i).evaluate(
            "(el, ms) => new Promise(r => { const t = Date.now(); (function wait() { "
            "if (el.data && el.data.length) r(true); else if (Date.now() - t > ms) r(false); "
            "else setTimeout(wait, 200); })(); })",
            left_ms,
        )
        if not drawn:
            undrawn.append(i)
    return undrawn


def _move(page, w: int, s: int, state: dict, path: str) -> dict:
    """Move visible slider `s` of widget `w` with the keyboard, one step at a time until its readout changes
    (at most 3 steps, right, or left for a slider at its highest value), and wait for a figure or label of that
    widget to change; returns what happened. Each step is a change the kernel redraws for, so no more are sent
    than it takes to move the readout; each waits for the readout (STEP_WAIT_S) before the next, so steps a busy
    browser has not yet handled are not counted as steps that changed nothing."""
    out = page.locator(".jp-OutputArea-output", has=page.locator(".widget-slider")).nth(w)
    slider = out.locator(".widget-slider").locator("visible=true").nth(s)
    slider.scroll_into_view_if_needed()
    handle = slider.locator(".noUi-handle").first
    at_top = handle.evaluate("h => Number(h.getAttribute('aria-valuenow')) >= Number(h.getAttribute('aria-valuemax'))")
    key = "ArrowLeft" if at_top else "ArrowRight"
    before = state["sliders"][s]["readout"]
    now = state
    handle.focus()
    for _ in range(3):
        page.keyboard.press(key)
        deadline = time.monotonic() + STEP_WAIT_S
        while True:
            now = page.evaluate(JS_WIDGET_STATE, w)
            if now["sliders"][s]["readout"] != before or time.monotonic() > deadline:
                break
            page.wait_for_timeout(100)
        if now["sliders"][s]["readout"] != before:
            break
    focus = None if now["sliders"][s]["readout"] != before else page.evaluate(JS_FOCUS)
    deadline = time.monotonic() + REDRAW_WAIT_S
    while time.monotonic() < deadline and (now["figures"], now["labels"]) == (state["figures"], state["labels"]):
        page.wait_for_timeout(150)
        now = page.evaluate(JS_WIDGET_STATE, w)
    now = _settle(page, w, path)
    return {
        "slider": state["sliders"][s]["label"],
        "from": before,
        "to": now["sliders"][s]["readout"],
        "moved": now["sliders"][s]["readout"] != before,
        "focus": focus,
        "redrew": (now["figures"], now["labels"]) != (state["figures"], state["labels"]),
        "state": now,
    }


def page_checks(page, path: str) -> dict:
    """What the page shows after run-all: problems (outputs that failed to render, sliders that do not move
    or redraw nothing, figures a reload does not restore), moves (one per slider), overlaps (text over text in a
    figure), widgets (how many explorers), labels_before / labels_after (each widget's label texts before the
    first move and after the last)."""
    report = {
        "problems": [],
        "moves": [],
        "overlaps": [],
        "widgets": 0,
        "reloaded": False,
        "labels_before": [],
        "labels_after": [],
    }
    shown = page.locator(".jp-OutputArea-output").all_inner_texts()
    report["problems"] += [f"{bad!r} shown in an output" for bad in BAD_RENDER if any(bad in t for t in shown)]
    page.set_viewport_size({"width": 1500, "height": 1000})
    report["overlaps"] = page.evaluate(JS_OVERLAPS)
    n = report["widgets"] = _widget_count(page)
    for w in range(n):
        undrawn = _show_figures(page, w)
        state = _settle(page, w, path)
        report["labels_before"].append(state["labels"])
        if not state["figures"]:
            report["problems"].append(f"widget {w}: no figure rendered")
        if undrawn:  # a move could change nothing visible: say so once instead of once per slider
            report["problems"].append(f"widget {w}: figure(s) {undrawn} not drawn {DRAW_WAIT_S} s after run-all")
            report["labels_after"].append(state["labels"])
            continue
        for label in [sl["label"] for sl in state["sliders"]]:
            visible = [sl["label"] for sl in state["sliders"]]
            if label not in visible:  # hidden by an earlier move (a control that could change nothing)
                continue
            move = _move(page, w, visible.index(label), state, path)
            state = move.pop("state")
            report["moves"].append(dict(move, widget=w))
            if not move["moved"]:
                report["problems"].append(
                    f"widget {w}: slider {move['slider']!r} did not move with the keyboard ({move['focus']})"
                )
            elif not move["redrew"]:
                report["problems"].append(
                    f"widget {w}: moving {move['slider']!r} ({move['from']} -> {move['to']}) "
                    "changed no figure and no label"
                )
        report["labels_after"].append(state["labels"])
    if n:
        report["problems"] += _reload_keeps_state(page, n, path)
        report["reloaded"] = True
    return report


def _reload_keeps_state(page, n: int, path: str) -> list:
    """Reload the page (the kernel keeps running) and compare every widget's sliders and figures with what
    they showed before."""
    before = [_settle(page, w, path) for w in range(n)]
    page.reload(wait_until="domcontentloaded")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    problems = []
    deadline = time.monotonic() + 60
    after = None
    while time.monotonic() < deadline:
        page.wait_for_timeout(500)
        if _widget_count(page) == n:
            for w in range(n):
                _show_figures(page, w)
            after = [_settle(page, w, path) for w in range(n)]
            if all(a["figures"] and all(f["data"] for f in a["figures"]) for a in after):
                break
    if after is None:
        return [f"after a reload {_widget_count(page)} of {n} widgets came back"]
    for w, (b, a) in enumerate(zip(before, after)):
        if [s["readout"] for s in a["sliders"]] != [s["readout"] for s in b["sliders"]]:
            problems.append(f"widget {w}: sliders changed in the reload")
        for f, (fb, fa) in enumerate(zip(b["figures"], a["figures"])):
            if fb != fa:
                same = "the same traces" if fb["data"] == fa["data"] else "other traces"
                problems.append(
                    f"widget {w}: after a reload figure {f} shows {fa['title']!r} with {same} than "
                    f"before, when it showed {fb['title']!r} ({len(fb['data'])} traces; the same sliders)"
                )
    return problems


def screenshots(page, folder: pathlib.Path) -> None:
    """Every output of the page as a PNG in `folder` (the notebook scrolls inside a fixed page, so the
    viewport is made tall first)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        page.screenshot(path=str(folder / "viewport.png"))
        page.set_viewport_size({"width": 1500, "height": 2400})
        page.wait_for_timeout(500)
        outputs = page.locator(".jp-OutputArea-output")
        for i in range(outputs.count()):
            loc = outputs.nth(i)
            box = loc.bounding_box()
            if box and box["width"] > 0 and box["height"] > 0:
                loc.scroll_into_view_if_needed(timeout=5000)
                loc.screenshot(path=str(folder / f"output_{i:02d}.png"), timeout=10_000)
    except Exception as e:  # noqa: BLE001 - a screenshot that fails must not hide the test's own failure
        print(f"screenshots into {folder} failed: {e}")
