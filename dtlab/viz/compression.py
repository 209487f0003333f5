"""Figures of lab 5's levers: bytes on the wire beside the gradient bytes, T_comm per sample, and the loss of a
compressed run beside an uncompressed one. Pure functions: DataFrame in (from :mod:`dtlab.model.compression`),
`plotly.graph_objects.Figure` out. Sizes on screen in MiB, times in ms."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dtlab.units import MIB, sig
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
    fig.add_trace(
        go.Bar(
            x=x,
            y=table["grad_bytes"] / MIB,
            name="gradient bytes",
            marker_color=COLORS["T_comp"],
            hovertemplate="%{x}<br>gradients %{y:.3f} MiB<extra></extra>",
        )
    )
    fig.add_trace(
        go.Bar(
            x=x,
            y=table["wire_bytes"] / MIB,
            name="bytes on the wire",
            marker_color=COLORS["T_comm"],
            customdata=table["ratio"],
            hovertemplate="%{x}<br>on the wire %{y:.3f} MiB<br>r = %{customdata:.4f}<extra></extra>",
        )
    )
    set_title(fig, title or "Bytes per rank and step: gradients vs on the wire (measured, per bucket record)")
    fig.update_layout(barmode="group", yaxis_title="MiB per rank per step", xaxis_title="run", height=380)
    return fig


def per_sample_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """T_comm and T_step per training sample (ms) per run: what communicating once per K micro-batches buys.
    table: :func:`dtlab.model.compression.lever_table`, or :func:`dtlab.course.claims.runs.timed_medians` of
    repeated runs (then the bars are medians over the runs and the error bars their range)."""
    x = table["label"].astype(str).tolist()
    fig = go.Figure()
    for key, name, color in (
        ("t_step_per_sample", "T_step per sample", COLORS["T_comp"]),
        ("t_comm_per_sample", "T_comm per sample", COLORS["T_comm"]),
    ):
        y = table[key] * 1e3
        err = None
        if f"{key}_lo" in table.columns:
            err = dict(
                type="data",
                symmetric=False,
                array=table[f"{key}_hi"] * 1e3 - y,
                arrayminus=y - table[f"{key}_lo"] * 1e3,
                color="#333",
            )
        fig.add_trace(
            go.Bar(
                x=x,
                y=y,
                name=name,
                marker_color=color,
                error_y=err,
                hovertemplate=f"%{{x}}<br>{name.split()[0]} %{{y:.3f}} ms/sample<extra></extra>",
            )
        )
    runs = f", medians of {int(table['runs'].min())} runs, bars: their range" if "runs" in table.columns else ""
    set_title(fig, title or f"Time per training sample (measured / samples per step{runs})")
    fig.update_layout(barmode="group", yaxis_title="ms per sample", xaxis_title="run", height=380)
    return fig


def loss_beside_figure(df: pd.DataFrame, label: str = "compressed", reference: str = "uncompressed") -> go.Figure:
    """The loss per step of a run and of its reference (same seed): :func:`dtlab.model.compression.loss_beside`."""
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(x=df["step"], y=df["loss_reference"], name=reference, mode="lines+markers", line=dict(color="#555"))
    )
    fig.add_trace(
        go.Scatter(
            x=df["step"], y=df["loss"], name=label, mode="lines+markers", line=dict(color=COLORS["T_comm"], dash="dot")
        )
    )
    set_title(fig, f"Training loss: {label} beside {reference} (same seed, mean over ranks)")
    fig.update_layout(xaxis_title="step", yaxis_title="loss (cross-entropy)", height=340)
    return fig


def lever_bytes_table(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`dtlab.model.compression.lever_table`'s byte counts for the screen, units in the column names:
    hook, micro-batches per step, gradient and wire bytes per rank-step, r, all-reduce rounds per micro-batch
    and the encode time per step."""
    return pd.DataFrame(
        {
            "run": table["label"],
            "comm hook": table["comm_hook"],
            "micro-batches per step": table["accumulate"].astype(int),
            "gradient bytes (B)": table["grad_bytes"].astype(int),
            "on the wire (B; median rank-step, PowerSGD's compressed steps)": table["wire_bytes"].astype(int),
            "r (wire / gradient)": table["ratio"].round(4),
            "all-reduce rounds per micro-batch": table["rounds_per_micro_batch"].round(3),
            "encode (ms per step)": [("0" if v == 0 else sig(v * 1e3, 3)) for v in table["encode_s"]],
        }
    )
