"""Figures that are drawn wherever a notebook is looked at: JupyterLab and Notebook 7 (plotly's own renderer), VS
Code and Colab (their renderers, or plotly's HTML), and an executed notebook exported with nbconvert to HTML or PDF,
where no widget manager and no plotly renderer runs.

A figure is shown as one MIME bundle (`figure_bundle`): what the renderers named by `plotly.io.renderers.default`
give (plotly picks them for the frontend it finds: 'plotly_mimetype' in Jupyter, 'colab' in Colab, 'vscode' in VS
Code; a user may set another, e.g. 'png'), and where those give no HTML or image, plotly's HTML of the figure as its
'notebook' renderer writes it. That HTML needs plotly.js in the page: it is displayed once per kernel, inline (4.8 MB,
no network needed), in the output of the cell that shows the first figure (`load_plotlyjs`), as plotly's own
'notebook' renderer does; a notebook whose first figure's cell is cleared loses it (run that cell again).

`LiveFigure` is an Output widget that holds one such bundle and redraws in place; `FigureBox` is a VBox of controls
and LiveFigures whose own bundle carries, beside the widget, the HTML of its figures as first drawn: nbconvert
exports that where the notebook holds no widget state (JupyterLab and Notebook 7 save none by default), and the
figures' current bundles where it does (`jupyter nbconvert --execute` saves it).
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import plotly.io as pio
from IPython import get_ipython
from IPython.display import display
from plotly.io.base_renderers import MimetypeRenderer
from plotly.offline import get_plotlyjs

#: MIME types a static export can show without plotly's renderer
STATIC = ("text/html", "image/png", "image/svg+xml", "image/jpeg")

_loaded = {"plotlyjs": False}


def load_plotlyjs() -> bool:
    """Display plotly.js once per kernel, inline (as plotly's 'notebook' renderer does when activated), so that the
    figures' HTML draws in a page without plotly's renderer; True when it is (or already was) displayed, False
    outside IPython."""
    if _loaded["plotlyjs"]:
        return True
    if get_ipython() is None:
        return False
    script = f"<script>window.PlotlyConfig = {{MathJaxConfig: 'local'}};</script>\n<script>{get_plotlyjs()}</script>"
    display({"text/html": script, "text/plain": "<plotly.js, loaded for the figures' HTML>"}, raw=True)
    _loaded["plotlyjs"] = True
    return True


def figure_bundle(fig: go.Figure) -> dict:
    """One MIME bundle for `fig`: the bundles of the renderers in `plotly.io.renderers.default` that make one
    (plotly's JSON where none does, e.g. 'browser' outside a notebook), plus plotly's 'notebook' HTML where they hold
    neither HTML nor an image (it draws with the plotly.js `load_plotlyjs` displays), plus a one-line text/plain."""
    spec = fig.to_dict()
    bundle: dict = {}
    for name in [n for n in (pio.renderers.default or "").split("+") if n]:
        renderer = pio.renderers[name]
        if hasattr(renderer, "to_mimebundle"):
            bundle.update(renderer.to_mimebundle(spec))
    if not bundle:
        bundle = pio.renderers["plotly_mimetype"].to_mimebundle(spec)
    if not any(m in bundle for m in STATIC):
        bundle["text/html"] = pio.renderers["notebook"].to_mimebundle(spec)["text/html"]
        load_plotlyjs()
    bundle["text/plain"] = f"<figure: {fig.layout.title.text or 'untitled'}>"
    return bundle


class CourseRenderer(MimetypeRenderer):
    """plotly's renderer 'dtlab': plotly's JSON (JupyterLab, Notebook 7 and VS Code draw it) and plotly's 'notebook'
    HTML beside it (an nbconvert export, nbviewer), with plotly.js displayed once (`load_plotlyjs`)."""

    def activate(self):
        load_plotlyjs()

    def to_mimebundle(self, fig_dict):
        load_plotlyjs()  # plotly activates a renderer on .show() only, not for a LiveFigure's bundle
        bundle = pio.renderers["plotly_mimetype"].to_mimebundle(fig_dict)
        bundle["text/html"] = pio.renderers["notebook"].to_mimebundle(fig_dict)["text/html"]
        return bundle


pio.renderers["dtlab"] = CourseRenderer()  # a name plotly knows; the default changes only in use_course_renderer


def use_course_renderer() -> str:
    """Make 'dtlab' plotly's default renderer where plotly chose 'plotly_mimetype' for a Jupyter kernel, so that a
    figure's `.show()` also draws in an export; a default plotly chose for Colab, VS Code or another frontend, or
    one a user set, stays. Returns the default now."""
    if pio.renderers.default == "plotly_mimetype" and get_ipython() is not None:
        pio.renderers.default = "dtlab"
    return pio.renderers.default


class LiveFigure(widgets.Output):
    """A figure that redraws: `show(fig)` replaces the widget's one output with `fig`'s bundle (`figure_bundle`),
    which JupyterLab's plotly renderer draws whole. `.figure` is the figure shown; `.data` and `.layout` are its.

    Not a plotly FigureWidget: on a loaded 2-core machine Chromium drew FigureWidgets blank, at their first display
    or after a slider move, until the page was reloaded: labs 3, 5 and 10 with in-place updates, labs 5 and 7 with
    a new FigureWidget per move (2 to 3 of the 4 labs with explorers, in runs with other test workers busy; never
    on a quiet machine). The output is the widget's synced state, so what a reload draws is always the figure of
    the current sliders, and an export that keeps the widgets' state keeps it."""

    def __init__(self, fig: go.Figure, **kwargs):
        super().__init__(**kwargs)
        self.figure = fig
        self.show(fig)

    def show(self, fig: go.Figure) -> None:
        """Show `fig` in place of the current figure."""
        self.figure = fig
        bundle = figure_bundle(fig)
        # emptied first, in a message of its own, so the new figure gets a renderer of its own: plotly's JupyterLab
        # renderer ignores a new model once it has drawn a plot (its renderModel returns at once), and JupyterLab
        # may hand an output that replaces one of the same type to the renderer already there. A precaution read
        # from that code: the browser tests pass with it; none was run without it since the check of moves was
        # fixed (it could not see a change in y alone)
        self.outputs = ()
        self.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    @property
    def data(self):
        return self.figure.data

    @property
    def layout(self):
        return self.figure.layout


def live_figures(widget) -> list[LiveFigure]:
    """The LiveFigures in `widget` and the boxes inside it, in display order."""
    if isinstance(widget, LiveFigure):
        return [widget]
    return [f for child in getattr(widget, "children", ()) for f in live_figures(child)]


class FigureBox(widgets.VBox):
    """A VBox of controls and LiveFigures whose bundle holds, beside the widget, the static HTML of its figures as
    they are when it is displayed: what a page without a widget manager shows (an nbconvert export, nbviewer)."""

    def _repr_mimebundle_(self, **kwargs):
        """The widget's bundle, the figures' HTML beside it, and how many figures it holds (metadata 'dtlab')."""
        bundle = super()._repr_mimebundle_(**kwargs)
        html = [figure_bundle(f.figure).get("text/html") for f in live_figures(self)]
        if any(html):
            bundle["text/html"] = "\n".join(h for h in html if h)
        return bundle, {"dtlab": {"figures": len(html)}}
