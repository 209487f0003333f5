"""The planner widget: DP x TP x PP layouts of a model on a number of GPUs, their memory per GPU and predicted step
(:mod:`dtlab.model.planner`), what does not fit marked, and the runs this machine made held against their
predictions.

`planner_figure(table, ...)` is pure (a table in, a Figure out). `planner(levels=..., compute=..., measured=...)`
returns an ipywidgets box: a model, sliders for GPUs, GPUs per node, GPU memory, global batch, sequence length and
micro-batches, toggles for sharded data parallelism and the schedule; a label saying where the interconnect's
alpha and beta and the compute come from (and what is an estimate); one figure, shown again whole on every move
(`dtlab.viz.livefigure.LiveFigure`: a reload draws what the sliders show).
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.model import planner as pl
from dtlab.units import fmt_time
from dtlab.viz.figures import set_title
from dtlab.viz.livefigure import FigureBox, LiveFigure

PARTS = (
    ("compute", "compute", "#4C78A8"),
    ("tp_comm", "TP all-reduces", "#F58518"),
    ("p2p", "PP sends", "#B279A2"),
    ("bubble", "bubble", "#BAB0AC"),
    ("dp_comm", "DP gradients", "#E45756"),
    ("optimizer", "optimizer", "#54A24B"),
)
MAX_BARS = 16
GPUS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
PER_NODE = [1, 2, 4, 8, 16]
MEMORY_GB = [8, 16, 24, 40, 80, 141]
BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
SEQ = [32, 64, 128, 256, 512, 1024, 2048]
MICRO = [1, 2, 4, 8, 16, 32, 64]


def planner_figure(
    table: pd.DataFrame, gpu_memory: float, measured: pd.DataFrame | None = None, title: str = ""
) -> go.Figure:
    """Top: the predicted step of each layout (ms), stacked by part, the layouts that do not fit faded; a marker
    where a run measured that layout. Bottom: memory per GPU (GB) with the GPU's memory as a line. At most
    MAX_BARS layouts, fastest first (those that fit before those that do not)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.62, 0.38])
    t = table.head(MAX_BARS)
    x = [f"{r.layout}{'' if r.fits else ' ✗'}" for r in t.itertuples()]
    opacity = [1.0 if f else 0.35 for f in t["fits"]]
    for col, name, color in PARTS:
        fig.add_trace(
            go.Bar(
                x=x,
                y=t[col] * 1e3,
                name=name,
                marker=dict(color=color, opacity=opacity),
                hovertemplate=f"%{{x}}: {name} %{{y:.3g}} ms<extra></extra>",
            ),
            1,
            1,
        )
    if measured is not None and len(measured):
        shown = measured[measured["layout"].isin(t["layout"])]
        xs = [x[list(t["layout"]).index(lay)] for lay in shown["layout"]]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=shown["t_step"] * 1e3,
                mode="markers",
                name="measured T_step",
                marker=dict(symbol="diamond", size=12, color="#222"),
                text=shown["label"],
                hovertemplate="%{text}: measured %{y:.3g} ms<extra></extra>",
            ),
            1,
            1,
        )
    fig.add_trace(
        go.Bar(
            x=x,
            y=t["memory"] / 1e9,
            name="memory per GPU",
            showlegend=False,
            marker=dict(color=["#72B7B2" if f else "#E45756" for f in t["fits"]]),
            hovertemplate="%{x}: %{y:.3g} GB per GPU<extra></extra>",
        ),
        2,
        1,
    )
    fig.add_hline(y=gpu_memory / 1e9, line=dict(color="#555", dash="dot"), row=2, col=1)
    fig.update_layout(barmode="stack", height=560, legend=dict(x=1.02, y=1, xanchor="left", yanchor="top"))
    fig.update_yaxes(title_text="step (ms)", row=1, col=1)
    fig.update_yaxes(title_text="GB per GPU", row=2, col=1)
    fig.update_xaxes(title_text="layout dp x tp x pp (✗: does not fit)", row=2, col=1)
    return set_title(fig, title or "Predicted step and memory per GPU of each layout")


def planner_table(table: pd.DataFrame) -> pd.DataFrame:
    """The planner's table for the screen: times in ms, memory in GB, the level each axis crosses."""
    out = table[
        [
            "layout",
            "microbatches",
            "fits",
            "memory",
            "t_step",
            "compute",
            "tp_comm",
            "p2p",
            "bubble",
            "dp_comm",
            "optimizer",
            "tp_level",
            "pp_level",
            "dp_level",
        ]
    ].copy()
    out["memory"] = (out["memory"] / 1e9).round(3)
    for c in ("t_step", "compute", "tp_comm", "p2p", "bubble", "dp_comm", "optimizer"):
        out[c] = (out[c] * 1e3).round(3)
    return out.rename(
        columns={
            "memory": "GB per GPU",
            "t_step": "step (ms)",
            "compute": "compute (ms)",
            "tp_comm": "TP (ms)",
            "p2p": "PP sends (ms)",
            "bubble": "bubble (ms)",
            "dp_comm": "DP (ms)",
            "optimizer": "optimizer (ms)",
        }
    )


def _controls(model: str, gpus: int, global_batch: int, seq: int, microbatches: int, schedule: str) -> dict:
    """The planner's controls, by name, at the given setting."""
    style, layout = {"description_width": "150px"}, widgets.Layout(width="460px")

    def sel(options, value, desc):
        return widgets.SelectionSlider(options=options, value=value, description=desc, style=style, layout=layout)

    return {
        "model": widgets.Dropdown(
            options=list(pl.MODELS), value=model, description="model", style=style, layout=layout
        ),
        "gpus": sel(GPUS, gpus, "GPUs"),
        "per_node": sel(PER_NODE, 8, "GPUs per node"),
        "memory_gb": sel(MEMORY_GB, 80, "GPU memory (GB)"),
        "batch": sel(BATCH, global_batch, "global batch"),
        "seq": sel(SEQ, seq, "sequence length"),
        "micro": sel(MICRO, microbatches, "micro-batches M"),
        "sharded": widgets.ToggleButtons(
            options=[("replicated", False), ("sharded (ZeRO-3, FSDP2)", True)],
            value=False,
            description="data parallel",
            style=style,
        ),
        "schedule": widgets.ToggleButtons(
            options=["1f1b", "gpipe"], value=schedule, description="schedule", style=style
        ),
    }


def planner(
    levels: dict,
    compute: dict,
    measured: pd.DataFrame | None = None,
    measured_setting: dict | None = None,
    model: str = "distilbert",
    gpus: int = 2,
    global_batch: int = 8,
    seq: int = 128,
    microbatches: int = 4,
    schedule: str = "1f1b",
):
    """The planner widget (display it as a cell's last expression). levels: alpha_intra, beta_intra, alpha_inter,
    beta_inter (s, s/B) and source (:func:`dtlab.model.planner.levels_from_profile`); compute:
    :func:`dtlab.model.planner.compute_from_run`; measured: :func:`dtlab.model.planner.measured_rows`, drawn
    while the controls show `measured_setting` (model, global_batch, seq, microbatches: what the runs ran)."""
    c = _controls(model, gpus, global_batch, seq, microbatches, schedule)
    label = widgets.HTML()
    setting = dict(measured_setting or {})

    def values():
        return {k: w.value for k, w in c.items()}

    def build():
        v = values()
        table = pl.plan(
            pl.MODELS[v["model"]],
            v["gpus"],
            gpus_per_node=v["per_node"],
            gpu_memory=v["memory_gb"] * 1e9,
            global_batch=v["batch"],
            seq=v["seq"],
            microbatches=v["micro"],
            schedule=v["schedule"],
            sharded=v["sharded"],
            levels=levels,
            compute=compute,
        )
        now = {"model": v["model"], "global_batch": v["batch"], "seq": v["seq"], "microbatches": v["micro"]}
        show = measured if measured is not None and setting and all(now[k] == setting[k] for k in setting) else None
        label.value = _label(v, table, levels, compute, measured, setting, show is not None)
        if table.empty:
            return set_title(
                go.Figure(),
                f"No layout of {v['gpus']} GPUs splits a global batch of {v['batch']} "
                f"into equal replicas and {v['micro']} micro-batches",
            ), table
        title = (
            f"{v['model']} ({pl.total_params(pl.MODELS[v['model']]) / 1e6:,.0f} M parameters) on {v['gpus']} "
            f"GPUs, {v['per_node']} per node: predicted step per layout (estimates)"
        )
        return planner_figure(table, v["memory_gb"] * 1e9, show, title), table

    fig0, table0 = build()
    figw = LiveFigure(fig0)
    box = FigureBox([label, widgets.VBox(list(c.values())), figw])
    box.controls, box.figure, box.table, box.values = c, figw, table0, values

    def redraw(change=None):
        fig, box.table = build()
        figw.show(fig)

    for w in c.values():
        w.observe(redraw, names="value")
    box.redraw = redraw
    return box


def _label(v, table, levels, compute, measured, setting, shown) -> str:
    fit = table[table["fits"]] if len(table) else table
    best = (
        f"fastest that fits: <b>{fit.iloc[0]['layout']}</b> (dp x tp x pp), "
        f"{fmt_time(float(fit.iloc[0]['t_step']))} predicted"
        if len(fit)
        else f"no layout fits in {v['memory_gb']} GB per GPU"
    )
    lines = [
        f"<b>interconnect</b>: {html.escape(levels.get('source', 'given by the caller'))}",
        f"<b>compute</b>: {html.escape(compute.get('source', 'given by the caller'))}; another model's is "
        "scaled by 6 x non-embedding parameters x tokens and split over tp x pp: an estimate",
        f"<b>setting</b>: {v['gpus']} GPUs ({v['per_node']} per node, {v['memory_gb']} GB each), global batch "
        f"{v['batch']} x {v['seq']} tokens, M = {v['micro']} ({v['schedule']}), data parallel "
        f"{'sharded' if v['sharded'] else 'replicated'}; {len(table)} layouts, {best}",
    ]
    if measured is not None and len(measured):
        want = ", ".join(f"{k} {val}" for k, val in setting.items())
        lines.append(
            f"<b>measured</b>: {len(measured)} run(s) of this machine, "
            + ("shown as ◆" if shown else f"hidden: they ran {html.escape(want)}")
        )
    return "<div style='font-size:90%;line-height:1.35'>" + "<br>".join(lines) + "</div>"
