"""An executed lab exported as a course collects it: nbconvert's HTML (what a student hands in or nbviewer shows)
holds every figure the lab drew, with plotly.js in the page once, and Chromium draws them from the file with no
network; the same page printed to PDF, as nbconvert's webpdf does. Lab 3 (quick mode): its explorer is a widget of
two figures (the predicted breakdown, the bucket timeline), its sweep's figure a plain plotly figure.

Two saves of the executed notebook: without the widgets' state (JupyterLab and Notebook 7 save none unless asked),
where nbconvert shows each widget's own HTML, and with it (nbclient and `jupyter nbconvert --execute` keep it), where
every figure inside a widget still holds its HTML beside plotly's JSON."""

import re
import warnings

import nbformat
import pytest
from labrun import drive, shared_browser
from labserver import CHROMIUM, CHROMIUM_ARGS, browser_missing
from nbconvert import HTMLExporter

LAB = "03_buckets_and_gpu_count.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def _figure_outputs(nb) -> list[dict]:
    """The outputs that draw figures: plotly's JSON, or a widget of dtlab's figures (an explorer: its metadata
    says how many; a progress bar is a widget without figures)."""
    return [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if PLOTLY in o.get("data", {}) or o.get("metadata", {}).get("dtlab", {}).get("figures")
    ]


def _figure_count(outputs) -> int:
    return sum(o.get("metadata", {}).get("dtlab", {}).get("figures", 1) for o in outputs)


def _export(nb) -> tuple[str, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        html, _ = HTMLExporter().from_notebook_node(nb)
    return html, [str(w.message) for w in caught if "not able to be represented" in str(w.message)]


@pytest.fixture(scope="module")
def lab():
    run = drive(LAB)
    figures = _figure_count(_figure_outputs(run.nb))
    assert figures >= 3, f"lab 3 drew {figures} figures: {run.path}"
    return run


def test_lab03_exported_to_html_without_widget_state_shows_every_figure(lab, tmp_path):
    nb = nbformat.from_dict(lab.nb)
    nb.metadata.pop("widgets", None)  # as JupyterLab saves it by default
    figures = _figure_outputs(nb)
    assert all("text/html" in o["data"] for o in figures), "a figure output without HTML for a static page"
    html, unrepresented = _export(nb)
    assert not unrepresented, unrepresented
    drawn, expected = len(re.findall(r"Plotly\.newPlot\(", html)), _figure_count(figures)
    assert drawn >= expected, f"{drawn} figures drawn in the HTML for {expected} in the outputs"
    assert html.count("* plotly.js v") == 1, "plotly.js must be in the page once, inline (no network)"
    (tmp_path / "lab03.html").write_text(html)


def test_lab03_exported_html_draws_in_chromium_offline_and_prints_to_pdf(lab, tmp_path):
    why = browser_missing()
    if why is not None:
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    nb = nbformat.from_dict(lab.nb)
    nb.metadata.pop("widgets", None)
    html, _ = _export(nb)
    page_file = tmp_path / "lab03.html"
    page_file.write_text(html)
    expected = len(re.findall(r"Plotly\.newPlot\(", html))
    # Playwright's sync API allows one running instance per thread: a worker that ran a lab already holds it
    shared = shared_browser()
    pw = browser = context = None
    try:
        if shared is None:
            pw = sync_playwright().start()
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = (shared or browser).new_context(offline=True)  # what a grader's machine without network shows
        page = context.new_page()
        page.emulate_media(media="print")
        page.goto(page_file.as_uri(), wait_until="load")
        page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length >= {expected}", timeout=60_000)
        drawn = page.evaluate("document.querySelectorAll('.js-plotly-plot').length")
        pdf = page.pdf(print_background=True)
    finally:
        closers = (lambda: context and context.close(), lambda: browser and browser.close(), lambda: pw and pw.stop())
        for close in closers:
            try:
                close()
            except Exception:  # noqa: BLE001 - the next test still needs the shared browser
                pass
    assert drawn >= expected
    assert pdf.startswith(b"%PDF") and len(pdf) > 50_000
