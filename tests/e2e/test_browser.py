"""Every lab in a real browser: JupyterLab + headless Chromium (Playwright), all cells run in quick mode.

What a student sees, checked the way a student would (tests/labrun.py runs each lab once; tests/labserver.py
drives the page): no error output and no stderr box other than progress bars, every output rendered, every
visible slider of every widget moved with the keyboard redraws a figure or a label, a reload of the page draws
the figures the sliders show, and no text overlaps another inside a figure (titles, axis titles, annotations,
legends). Lab 3's explorer is also checked in detail: the label says where alpha and beta come from, and only
the moved slider is labelled as moved. Each lab's run time is printed (pytest -s shows it).

Needs the Python package `playwright` and Debian's chromium (`apt-get install -y chromium`; Playwright's own
browser download is not used); skipped otherwise (tests/test_notebooks.py then runs the labs headless).
$DTLAB_SCREENSHOTS: a folder for screenshots of every output (taken on failure in any case).
"""

from __future__ import annotations

import pytest
from labrun import LABS, drive, error_outputs
from labserver import browser_missing

#: labs whose widgets must be there (the others may have none)
WIDGETS = {
    "03_buckets_and_gpu_count.ipynb": 1,
    "05_shrinking_comm.ipynb": 1,
    "07_beyond_one_machine.ipynb": 1,
    "10_tensor_and_pipeline.ipynb": 1,
}


@pytest.fixture(scope="module", autouse=True)
def _browser():
    why = browser_missing()
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("name", LABS)
def test_lab_in_a_real_browser(name):
    run = drive(name)
    assert run.browser
    errors = error_outputs(run.nb)
    assert not errors, f"{name}: error output:\n" + "\n".join(errors)
    page = run.page
    assert not page["page_errors"], f"{name}: JavaScript errors on the page: {page['page_errors']}"
    assert not page["problems"], f"{name}:\n" + "\n".join(
        page["problems"] + ["browser console errors:"] + page["console_errors"][-10:]
    )
    assert not page["overlaps"], f"{name}: overlapping text in a figure:\n" + "\n".join(page["overlaps"])
    assert page["widgets"] >= WIDGETS.get(name, 0), f"{name}: {page['widgets']} widgets rendered"
    if page["widgets"]:
        assert page["reloaded"] and page["moves"] and all(m["redrew"] for m in page["moves"])
    print(
        f"{name}: run-all {run.seconds:.0f} s in the browser; {len(page['moves'])} slider moves, "
        f"{page['widgets']} widget(s)"
    )


def test_lab03_explorer_says_where_alpha_and_beta_come_from():
    """Lab 3's explorer label: fitted (or a labelled default) before anything moves; the browser's echo of a
    snapped value is not a move; after the moves of the page checks, 'moved by you' names exactly the moved
    sliders (each of alpha and 1/beta at most once)."""
    run = drive("03_buckets_and_gpu_count.ipynb")
    moves = [m for m in run.page["moves"] if m["widget"] == 0]
    assert {"α latency (µs)", "1/β bandwidth (GB/s)"} <= {m["slider"] for m in moves}, moves
    first, last = run.page["labels_before"][0][0], run.page["labels_after"][0][0]
    # nobody had touched a slider: the browser's own echo of the values must not read as a move
    assert "moved by you" not in first and "set by hand" not in first, first
    assert "fitted from the profile" in first or "default, not calibrated" in first, first
    assert last.count("moved by you, the model uses this value") == 2, last  # alpha and 1/beta, each once
