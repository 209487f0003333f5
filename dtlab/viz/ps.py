"""Parameter server vs ring all-reduce, as pure figures (DataFrame in, plotly Figure out).

- `ps_vs_ring_figure(sweep_df)`: real training runs from `dtlab.sweep(base, strategy=["ddp", "ps"], nproc=...,
  bucket_mb=...)`: T_step and T_comm against the number of ranks, one line per strategy and bucket size.
- `ps_shapes_figure(samples)`: collective samples from `dtlab.calibrate(ops=("all_reduce", "ps"), group_sizes=...)`:
  time against message size per p, and the PS / ring time ratio against p beside each form's ratio
  (dtlab.model.ps).

Oversubscribed points (more CPU ranks than cores) are drawn as open markers and named in the hover text and the
legend: their time includes waiting for a core.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.model import ps as psmodel
from dtlab.model.link import Link
from dtlab.viz.figures import set_title

STRATEGY_COLORS = {"ddp": "#4C78A8", "ps": "#E45756", "zero3": "#54A24B"}
STRATEGY_NAMES = {"ddp": "ring all-reduce (ddp)", "ps": "reduce + broadcast (ps)", "zero3": "zero3"}
OP_NAMES = {"all_reduce": "ring all-reduce", "ps": "reduce + broadcast (ps)"}
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")


def ps_vs_ring_figure(
    df: pd.DataFrame, title: str = "Parameter server vs ring all-reduce (real training)"
) -> go.Figure:
    """T_step and T_comm (ms) against ranks p, per strategy (colour) and bucket size (dash), from a sweep table
    (columns strategy, nproc, bucket_mb, t_step, t_comm, oversubscribed, status). Failed or skipped points are
    left out; oversubscribed ones are open markers."""
    need = {"strategy", "nproc", "bucket_mb", "t_step", "t_comm", "oversubscribed"}
    if not isinstance(df, pd.DataFrame) or not need <= set(df.columns):
        raise ValueError(f"df must be a sweep table with columns {sorted(need)} (dtlab.sweep(..., strategy=[...]))")
    ok = df[df["t_step"].notna()].sort_values(["strategy", "bucket_mb", "nproc"])
    fig = make_subplots(rows=1, cols=2, subplot_titles=("T_step (ms)", "T_comm (ms)"), horizontal_spacing=0.1)
    buckets = sorted(ok["bucket_mb"].unique())
    for (st, b), g in ok.groupby(["strategy", "bucket_mb"], sort=True):
        over = g["oversubscribed"].fillna(False).astype(bool).to_numpy()
        name = f"{STRATEGY_NAMES.get(st, st)}, {b:g} MiB buckets"
        hover = [
            f"{name}<br>p={int(p)}{' (oversubscribed: more ranks than cores)' if o else ''}"
            for p, o in zip(g["nproc"], over)
        ]
        for col, q in ((1, "t_step"), (2, "t_comm")):
            fig.add_trace(
                go.Scatter(
                    x=g["nproc"],
                    y=g[q] * 1e3,
                    mode="lines+markers",
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    line=dict(color=STRATEGY_COLORS.get(st, "#888"), dash=DASHES[buckets.index(b) % len(DASHES)]),
                    marker=dict(size=9, symbol=np.where(over, "circle-open", "circle")),
                    hovertext=[f"{h}<br>{q}: {v * 1e3:.1f} ms" for h, v in zip(hover, g[q])],
                    hoverinfo="text",
                ),
                row=1,
                col=col,
            )
    over_p = sorted(ok.loc[ok["oversubscribed"].fillna(False).astype(bool), "nproc"].unique())
    if over_p:
        for col in (1, 2):
            fig.add_vrect(
                x0=min(over_p) - 0.5, x1=max(over_p) + 0.5, fillcolor="#888", opacity=0.1, line_width=0, row=1, col=col
            )
        fig.add_annotation(
            text="shaded, open markers: oversubscribed (more ranks than CPU cores)",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0,
            y=-0.2,
            yanchor="top",
            xanchor="left",
            font=dict(size=11),
        )
    fig.update_xaxes(title_text="ranks p", dtick=1)
    fig.update_yaxes(rangemode="tozero")
    # the legend to the right of the plots (below them it ran into the axis titles), the subplot titles
    # between the figure's title and the plots
    fig.update_layout(legend=dict(font=dict(size=11)), margin=dict(b=90), height=460)
    return set_title(fig, title, extra_top=24)


def ps_shapes_figure(
    samples: pd.DataFrame,
    cpu_cores: int | None = None,
    title: str = "Reduce + broadcast vs ring all-reduce (collectives alone)",
) -> go.Figure:
    """Left: median seconds per call (ms, log-log) against message size for each op and p. Right: the PS / ring
    ratio of the medians against p, one line per size, beside the forms' ratios for large n (textbook and
    server link: p; gloo's reduce + broadcast; NCCL's). `samples`: a profile's samples (columns op, nbytes,
    nproc, seconds) with both ops; `cpu_cores` marks p above it as oversubscribed."""
    need = {"op", "nbytes", "nproc", "seconds"}
    if not isinstance(samples, pd.DataFrame) or not need <= set(samples.columns):
        raise ValueError(f"samples must have columns {sorted(need)} (a Profile's samples)")
    if not {"all_reduce", "ps"} <= set(samples["op"]):
        raise ValueError("samples must hold both ops 'all_reduce' and 'ps' (dtlab.calibrate(ops=('all_reduce', 'ps')))")
    med = samples.groupby(["op", "nproc", "nbytes"])["seconds"].median()
    ps_ = sorted(int(p) for p in samples["nproc"].unique())
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("time per call (ms, log-log)", "PS / ring time ratio"), horizontal_spacing=0.12
    )
    palette = ("#4C78A8", "#F58518", "#54A24B", "#B279A2", "#9D755D")
    for op in ("all_reduce", "ps"):
        for i, p in enumerate(ps_):
            s = med[op][p]
            over = cpu_cores is not None and p > cpu_cores
            fig.add_trace(
                go.Scatter(
                    x=s.index,
                    y=s.to_numpy() * 1e3,
                    mode="lines+markers",
                    name=f"{OP_NAMES[op]}, p={p}" + (" (oversubscribed)" if over else ""),
                    line=dict(color=palette[i % len(palette)], dash="solid" if op == "ps" else "dot"),
                    marker=dict(symbol="circle-open" if over else ("square" if op == "ps" else "circle"), size=8),
                ),
                row=1,
                col=1,
            )
    ratio = (med["ps"] / med["all_reduce"]).dropna().rename("ratio").reset_index()
    for i, (n, g) in enumerate(ratio.groupby("nbytes")):
        fig.add_trace(
            go.Scatter(
                x=g["nproc"],
                y=g["ratio"],
                mode="lines+markers",
                name=f"measured, {n / 2**20:.3g} MiB",
                line=dict(color="#444", width=1 + 2 * i / max(1, ratio["nbytes"].nunique() - 1)),
            ),
            row=1,
            col=2,
        )
    grid = np.arange(min(ps_), max(ps_) + 1)
    forms = psmodel.forms_table(Link(alpha=0.0, beta=1.0), 1.0, grid)  # ratios: the bandwidth terms alone
    for col, name, dash in (
        ("ps_over_ring_server", "form: textbook / server link (p)", "dash"),
        ("ps_over_ring_gloo", "form: gloo's algorithms", "dot"),
        ("ps_over_ring_nccl", "form: NCCL's pipelined rings", "dashdot"),
    ):
        fig.add_trace(
            go.Scatter(x=grid, y=forms[col], mode="lines", name=name, line=dict(color="#E45756", dash=dash)),
            row=1,
            col=2,
        )
    if cpu_cores is not None and max(ps_) > cpu_cores:
        fig.add_vrect(x0=cpu_cores + 0.5, x1=max(ps_) + 0.5, fillcolor="#888", opacity=0.1, line_width=0, row=1, col=2)
    fig.update_xaxes(type="log", title_text="message size (bytes)", row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="ranks p", dtick=1, row=1, col=2)
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    fig.update_layout(legend=dict(font=dict(size=11)), height=480)  # to the right: below, it hid the axis titles
    return set_title(fig, title, extra_top=24)  # room for the subplot titles under the figure's title
