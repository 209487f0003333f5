"""A figure's one bundle (dtlab.viz.livefigure): plotly's JSON for the renderers that draw it and HTML for a page
without them, plotly's default renderer respected, and a box of figures that carries their HTML beside the widget."""

import ipywidgets as widgets
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from dtlab.viz.livefigure import FigureBox, LiveFigure, figure_bundle, live_figures, use_course_renderer


@pytest.fixture
def default_renderer():
    was = pio.renderers.default
    yield
    pio.renderers.default = was


def _fig(title="T_step per bucket cap (ms)"):
    return go.Figure(go.Bar(x=[1, 2], y=[3, 4]), layout=dict(title=title))


def test_a_jupyter_default_gets_plotlys_json_and_html_beside_it(default_renderer):
    pio.renderers.default = "plotly_mimetype"
    b = figure_bundle(_fig())
    assert b["application/vnd.plotly.v1+json"]["data"][0]["y"] == [3, 4]
    assert "Plotly.newPlot(" in b["text/html"] and "plotly.js v" not in b["text/html"]  # plotly.js comes once
    assert b["text/plain"] == "<figure: T_step per bucket cap (ms)>"


def test_a_default_that_makes_html_is_used_as_it_is(default_renderer):
    pio.renderers.default = "colab"  # Colab draws each output in a frame of its own: plotly.js from its CDN there
    b = figure_bundle(_fig())
    assert "application/vnd.plotly.v1+json" not in b and "cdn.plot.ly" in b["text/html"]


def test_outside_a_notebook_the_bundle_still_holds_both(default_renderer):
    pio.renderers.default = "browser"  # no bundle of its own: plotly's JSON, then the HTML
    b = figure_bundle(_fig())
    assert "application/vnd.plotly.v1+json" in b and "Plotly.newPlot(" in b["text/html"]
    assert use_course_renderer() == "browser"  # outside IPython, and another default: left alone


def test_the_course_renderer_draws_both(default_renderer):
    b = pio.renderers["dtlab"].to_mimebundle(_fig().to_dict())
    assert set(b) == {"application/vnd.plotly.v1+json", "text/html"}


def test_a_box_of_figures_carries_their_html_and_count_beside_the_widget(default_renderer):
    pio.renderers.default = "plotly_mimetype"
    a, b = LiveFigure(_fig("first")), LiveFigure(_fig("second"))
    box = FigureBox([widgets.HTML("controls"), widgets.VBox([a]), b])
    assert live_figures(box) == [a, b]
    b.show(_fig("second, redrawn"))
    data, meta = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data and meta == {"dtlab": {"figures": 2}}
    assert data["text/html"].count("Plotly.newPlot(") == 2 and "second, redrawn" in data["text/html"]
    (out,) = b.outputs
    assert "text/html" in out["data"] and "application/vnd.plotly.v1+json" in out["data"]
