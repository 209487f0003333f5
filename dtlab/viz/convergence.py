"""Does it still learn? Accuracy against steps and against time, one line per lever, and the model's time to target.

- `convergence_figure(curves, target, predicted)`: pure. Left: held-out accuracy against optimizer steps (the
  asynchronous server's updates); right: against training time (s, evaluations left out). One colour per lever in
  both; the target as a dashed line; on the right, an open diamond per lever at the model's time to target
  (dtlab.model.convergence: measured steps x predicted T_step).
- `time_to_target_figure(table, title)`: pure. Bars of the predicted time to target per lever.
- `convergence_explorer(levers, ...)`: widgets. Sliders for the link's bandwidth, its latency and the number of
  ranks p re-evaluate the time-to-target model (nothing is run) and redraw the bars; the label names the lever
  that reaches the target first and, per lever, the bandwidth above which it stops paying against the baseline.
"""

from __future__ import annotations

import math

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.model.convergence import ASSUMPTION, crossover_bandwidth, first_to_target, time_to_target
from dtlab.model.link import one_level
from dtlab.viz.figures import set_title
from dtlab.viz.livefigure import FigureBox, LiveFigure

PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D")


def convergence_figure(
    curves: dict,
    target: float,
    predicted: pd.DataFrame | None = None,
    title: str = "Held-out accuracy against steps and against time",
) -> go.Figure:
    """curves: label -> a run's `evals` frame (step, t, accuracy); predicted: dtlab.model.convergence.time_to_target's
    table (label, time), drawn on the right as the model's time to target."""
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("against optimizer steps", "against training time (s)"), horizontal_spacing=0.08
    )
    pred = predicted.set_index("label")["time"] if predicted is not None and not predicted.empty else {}
    for i, (label, ev) in enumerate(curves.items()):
        color = PALETTE[i % len(PALETTE)]
        for col, x in ((1, "step"), (2, "t")):
            fig.add_trace(
                go.Scatter(
                    x=ev[x],
                    y=ev["accuracy"],
                    mode="lines+markers",
                    name=label,
                    legendgroup=label,
                    showlegend=col == 1,
                    line=dict(color=color),
                    marker=dict(size=5),
                    hovertemplate=f"{label}<br>{x} %{{x:.3g}}<br>accuracy %{{y:.3f}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        t = pred.get(label) if hasattr(pred, "get") else None
        if t is not None and not (isinstance(t, float) and math.isnan(t)):
            fig.add_trace(
                go.Scatter(
                    x=[t],
                    y=[target],
                    mode="markers",
                    name=f"{label}: model",
                    legendgroup=label,
                    showlegend=False,
                    marker=dict(symbol="diamond-open", size=13, color=color, line=dict(width=2)),
                    hovertemplate=f"{label}: the model's time to {target:g}: %{{x:.3g}} s<extra></extra>",
                ),
                row=1,
                col=2,
            )
    for col in (1, 2):
        fig.add_hline(y=target, line=dict(dash="dash", color="#888", width=1), row=1, col=col)
    fig.update_yaxes(title_text="held-out accuracy", row=1, col=1)
    fig.update_xaxes(title_text="optimizer steps (async: server updates)", row=1, col=1)
    fig.update_xaxes(title_text="s (diamonds: the model's time to target)", row=1, col=2)
    fig.update_layout(height=440, legend=dict(font=dict(size=11)))
    return set_title(fig, f"{title}; dashed: the target {target:g}", extra_top=24)


def time_to_target_figure(table: pd.DataFrame, title: str) -> go.Figure:
    """Bars of the predicted time to target (s) per lever, from `time_to_target`; a lever that never reached the
    target is named under an empty bar."""
    labels = [
        f"{r.label}<br>(never reached)" if r.steps is None or pd.isna(r.steps) else r.label for r in table.itertuples()
    ]
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(table))]
    times = [None if pd.isna(t) else float(t) for t in table["time"]]
    text = ["" if t is None else f"{t:.3g} s" for t in times]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=times,
            marker_color=colors,
            text=text,
            textposition="auto",
            hovertext=[f"{r.label}: {r.steps} steps x {r.t_step * 1e3:.3g} ms" for r in table.itertuples()],
            hoverinfo="text",
        )
    )
    fig.update_layout(yaxis_title="predicted time to target (s)", height=380, showlegend=False)
    return set_title(fig, title)


class ConvergenceExplorer(FigureBox):
    """The time-to-target explorer (see `convergence_explorer`): `.sliders`, `.figure`, `.label`, `.table`."""

    def __init__(
        self,
        levers,
        *,
        t_comp: float,
        nbytes: float,
        nproc: int,
        link,
        target: float,
        t_apply: float = 0.0,
        source: str = "",
    ):
        self.link = one_level(link)
        if not self.link.beta > 0:
            raise ValueError(f"link: beta must be > 0 s/B for the bandwidth slider (1/beta), got {self.link.beta!r}")
        self.levers, self.target, self.source = list(levers), target, source or f"Link: {self.link.source}."
        self.fixed = dict(t_comp=t_comp, nbytes=nbytes, t_apply=t_apply)
        style, layout = {"description_width": "150px"}, widgets.Layout(width="480px")
        alpha, gbs = self.link.alpha, 1.0 / self.link.beta / 1e9
        self.sliders = {
            "bandwidth_gbs": widgets.FloatLogSlider(
                value=gbs,
                base=10,
                min=math.floor(math.log10(gbs)) - 3,
                max=math.ceil(math.log10(gbs)) + 3,
                step=0.25,
                description="bandwidth 1/β (GB/s)",
                readout_format=".3g",
                style=style,
                layout=layout,
            ),
            "alpha_us": widgets.FloatLogSlider(
                value=max(alpha * 1e6, 0.1),
                base=10,
                min=-1,
                max=4,
                step=0.25,
                description="latency α (µs)",
                readout_format=".3g",
                style=style,
                layout=layout,
            ),
            "nproc": widgets.IntSlider(value=nproc, min=2, max=64, description="ranks p", style=style, layout=layout),
        }
        self.label = widgets.HTML()
        self.table = self._model()
        self.figure = LiveFigure(self._fig())
        for s in self.sliders.values():
            s.observe(self._redraw, names="value")
        self._label()
        super().__init__(children=[widgets.VBox(list(self.sliders.values())), self.label, self.figure])

    def params(self) -> dict:
        """The model's inputs at the sliders: t_comp, nbytes, t_apply, nproc and the link (the given link's form,
        alpha and beta as the sliders show them)."""
        v = {k: s.value for k, s in self.sliders.items()}
        link = self.link.replace(alpha=v["alpha_us"] * 1e-6, beta=1.0 / (v["bandwidth_gbs"] * 1e9))
        return dict(self.fixed, nproc=int(v["nproc"]), link=link)

    def _model(self) -> pd.DataFrame:
        return time_to_target(self.levers, **self.params())

    def _fig(self) -> go.Figure:
        p = self.params()
        lk = p["link"]
        return time_to_target_figure(
            self.table,
            f"Predicted time to {self.target:g}: p = {p['nproc']}, "
            f"α = {lk.alpha * 1e6:.3g} µs, 1/β = {1 / lk.beta / 1e9:.3g} GB/s",
        )

    def _label(self) -> None:
        p = self.params()
        first = first_to_target(self.table)
        base = next((lv for lv in self.levers if lv.kind == "sync"), None)
        kw, lk = dict(p), p["link"]
        lines = [
            f"<b>First to {self.target:g}</b> at 1/β = {1 / lk.beta / 1e9:.3g} GB/s, α = {lk.alpha * 1e6:.3g} µs, "
            f"p = {p['nproc']}: <b>{first or 'none of them'}</b> (the model: measured steps x predicted T_step)."
        ]
        for lv in self.levers:
            if base is None or lv is base or lv.steps is None or base.steps is None:
                continue
            x = crossover_bandwidth(lv, base, **kw)
            if x is None:
                finding = "no crossover between 0.001 and 10,000 GB/s"
            else:  # which side wins: look just below the crossover
                below = time_to_target([lv, base], **dict(kw, link=lk.replace(beta=1.0 / (x / 10 * 1e9))))["time"]
                wins_below = below.iloc[0] < below.iloc[1]
                finding = (
                    f"beats {base.label} {'below' if wins_below else 'above'} {x:.3g} GB/s, stops paying "
                    f"{'above' if wins_below else 'below'} it"
                )
            lines.append(f"{lv.label} ({lv.steps} steps against {base.steps}): {finding}")
        lines.append(f"<i>{ASSUMPTION}. {self.source}</i>")
        self.label.value = "<br>".join(lines)

    def _redraw(self, change=None) -> None:
        self.table = self._model()
        self.figure.show(self._fig())
        self._label()


def convergence_explorer(
    levers,
    *,
    t_comp: float,
    nbytes: float,
    nproc: int,
    link,
    target: float,
    t_apply: float = 0.0,
    source: str = "",
) -> ConvergenceExplorer:
    """Sliders over the time-to-target model (dtlab.model.convergence) for `levers` (Lever objects with their
    measured steps to `target`): the link's bandwidth 1/β (GB/s) and latency α, and the ranks p, start at `link`'s
    (a Link or a Profile: a calibration of this machine; its form is kept; `source` says where it comes from,
    default the link's own source). T_comp, the gradient bytes and the server's update time stay fixed. Display it
    as a cell's last expression."""
    return ConvergenceExplorer(
        levers, t_comp=t_comp, nbytes=nbytes, nproc=nproc, link=link, target=target, t_apply=t_apply, source=source
    )
