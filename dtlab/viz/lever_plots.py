"""Figures of lab 5's levers: bytes on the wire beside the gradient bytes, T_comm per sample, and the loss of a
compressed run beside an uncompressed one. Pure functions: DataFrame in (from :mod:`dtlab.model.compression`),
`plotly.graph_objects.Figure` out. Sizes on screen in MiB, times in ms."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dtlab.units import MIB
from dtlab.viz.figures import COLORS, set_title


def wire_bytes_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Grouped bars per run: gradient bytes and bytes on the wire per rank and step (MiB), r on hover.
    table: :func:`dtlab.model.compression.lever_table`."""
    need = ("label", "grad_bytes", "wire_bytes", "ratio")
    missing = [c for c in need if c not in table.columns]
    if missing:
        raise ValueError(f"table is missing columns {missing}; use dtlab.model.compression.lever_table")
    x = table["label"].astype(str).tolist()
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=table["grad_bytes"] / MIB, name="gradient bytes", marker_color=COLORS["T_comp"],
                         hovertemplate="%{x}<br>gradients %{y:.3f} MiB<extra></extra>"))
    fig.add_trace(go.Bar(x=x, y=table["wire_bytes"] / MIB, name="bytes on the wire", marker_color=COLORS["T_comm"],
                         customdata=table["ratio"], hovertemplate="%{x}<br>on the wire %{y:.3f} MiB"
                                                                  "<br>r = %{customdata:.4f}<extra></extra>"))
    set_title(fig, title or "Bytes per rank and step: gradients vs on the wire (measured, per bucket record)")
    fig.update_layout(barmode="group", yaxis_title="MiB per rank per step", xaxis_title="run", height=380)
    return fig


def per_sample_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """T_comm and T_step per training sample (ms) per run: what communicating once per K micro-batches buys.
    table: :func:`dtlab.model.compression.lever_table`."""
    x = table["label"].astype(str).tolist()
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=table["t_step_per_sample"] * 1e3, name="T_step per sample",
                         marker_color=COLORS["T_comp"], hovertemplate="%{x}<br>T_step %{y:.3f} ms/sample<extra></extra>"))
    fig.add_trace(go.Bar(x=x, y=table["t_comm_per_sample"] * 1e3, name="T_comm per sample",
                         marker_color=COLORS["T_comm"], hovertemplate="%{x}<br>T_comm %{y:.3f} ms/sample<extra></extra>"))
    set_title(fig, title or "Time per training sample (measured medians / samples per step)")
    fig.update_layout(barmode="group", yaxis_title="ms per sample", xaxis_title="run", height=380)
    return fig


def loss_beside_figure(df: pd.DataFrame, label: str = "compressed", reference: str = "uncompressed") -> go.Figure:
    """The loss per step of a run and of its reference (same seed): :func:`dtlab.model.compression.loss_beside`."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=df["step"], y=df["loss_reference"], name=reference, mode="lines+markers",
                             line=dict(color="#555")))
    fig.add_trace(go.Scatter(x=df["step"], y=df["loss"], name=label, mode="lines+markers",
                             line=dict(color=COLORS["T_comm"], dash="dot")))
    set_title(fig, f"Training loss: {label} beside {reference} (same seed, mean over ranks)")
    fig.update_layout(xaxis_title="step", yaxis_title="loss (cross-entropy)", height=340)
    return fig
