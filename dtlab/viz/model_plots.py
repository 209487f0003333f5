"""Step-level figures of the what-if model: the predicted breakdown per configuration and the bucket queue
of one predicted step.

Pure functions: data in, `plotly.graph_objects.Figure` out. Nothing here imports torch or ipywidgets, so the
module is cheap to import and test; :mod:`dtlab.viz.dashboard` wraps these figures in widgets. The model
itself (whatif, whatif_sweep, compute_from_run, ...) is in :mod:`dtlab.model.whatif`; the calibration and
textbook-vs-ring figures are in :mod:`dtlab.viz.calibration`.

Units: data in seconds and bytes; on screen times are milliseconds, sizes MiB. Every axis names its unit.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dtlab.units import MIB, fmt_mib
from dtlab.viz.figures import COLORS, add_phase_bar, set_title


def predicted_breakdown_figure(
    df: pd.DataFrame, measured: pd.DataFrame | None = None, highlight: str | None = None, title: str | None = None
) -> go.Figure:
    """Predicted step breakdown per configuration: stacked T_comp + exposed communication (ms).

    df: one row per configuration with columns label (x, e.g. 'p=4, 25 MiB'), t_comp, t_comm, exposed
    (seconds), e.g. from :func:`dtlab.model.whatif.whatif_sweep`. The bar height is the predicted T_step;
    T_comm (all of the communication, hidden or not) is drawn as a diamond marker line.

    measured: optional DataFrame with label and t_step (seconds), optionally t_comm and t_comp, drawn
    as markers named "measured ...". One trace per measured column present, even when it has no rows,
    so a caller that updates the figure in place sees a fixed set of traces.

    highlight: a label whose bars get an outline (the current setting in the explorer).
    """
    missing = [c for c in ("label", "t_comp", "t_comm", "exposed") if c not in df.columns]
    if missing:
        raise ValueError(f"df is missing columns {missing}; required: label, t_comp, t_comm, exposed (seconds)")
    labels = df["label"].astype(str).tolist()
    t_comp = df["t_comp"].to_numpy(float) * 1e3
    exposed = df["exposed"].to_numpy(float) * 1e3
    t_comm = df["t_comm"].to_numpy(float) * 1e3
    outline = [2.5 if lab == highlight else 0.0 for lab in labels]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=labels,
            y=t_comp,
            name="T_comp (predicted)",
            marker_color=COLORS["T_comp"],
            marker_line=dict(width=outline, color="#111"),
            hovertemplate="%{x}<br>T_comp %{y:.2f} ms<extra></extra>",
        )
    )
    fig.add_trace(
        go.Bar(
            x=labels,
            y=exposed,
            name="exposed comm (predicted)",
            marker_color=COLORS["exposed"],
            marker_line=dict(width=outline, color="#111"),
            customdata=np.column_stack([t_comp + exposed, t_comm]) if len(labels) else None,
            hovertemplate=(
                "%{x}<br>exposed %{y:.2f} ms<br>T_step %{customdata[0]:.2f} ms"
                "<br>T_comm %{customdata[1]:.2f} ms<extra></extra>"
            ),
        )
    )
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=t_comm,
            name="T_comm (predicted, hidden + exposed)",
            mode="lines+markers",
            marker=dict(symbol="diamond", size=10, color=COLORS["T_comm"]),
            line=dict(color=COLORS["T_comm"], width=1, dash="dot"),
            hovertemplate="%{x}<br>T_comm %{y:.2f} ms<extra></extra>",
        )
    )
    if measured is not None:
        _add_measured_markers(fig, measured)
    set_title(fig, title or "Predicted step time: compute + exposed communication")
    fig.update_layout(
        barmode="stack",
        xaxis_title="configuration (GPU count p, bucket size in MiB)",
        yaxis_title="time per step (ms)",
        height=420,
        legend=dict(font_size=11),
        xaxis=dict(type="category", categoryorder="array", categoryarray=labels),
    )
    return fig


def _add_measured_markers(fig: go.Figure, measured: pd.DataFrame) -> None:
    """The measured T_step (and T_comm, T_comp where given) as markers, one trace per column present."""
    if "label" not in measured.columns or "t_step" not in measured.columns:
        raise ValueError("measured needs columns label and t_step (seconds); t_comm, t_comp are optional")
    style = {
        "t_step": ("measured T_step", dict(symbol="x", size=12, color="#111")),
        "t_comm": (
            "measured T_comm",
            dict(symbol="diamond-open", size=12, color=COLORS["T_comm"], line=dict(width=2)),
        ),
        # gold, not the T_comp bar's blue: drawn on that bar, a blue mark would be invisible
        "t_comp": ("measured T_comp", dict(symbol="line-ew-open", size=30, color="#F2C12E", line=dict(width=4))),
    }
    for col, (name, marker) in style.items():
        if col not in measured.columns:
            continue
        fig.add_trace(
            go.Scatter(
                x=measured["label"].astype(str).tolist(),
                y=measured[col].to_numpy(float) * 1e3,
                mode="markers",
                name=name,
                marker=marker,
                hovertemplate="%{x}<br>" + name + " %{y:.2f} ms<extra></extra>",
            )
        )


def _add_compute_row(fig: go.Figure, t_fwd: float, t_bwd: float, exposed: float, t_opt: float) -> None:
    """Row 'compute' of the bucket queue: forward, backward, the wait for exposed communication, optimizer."""
    bwd_end = t_fwd + t_bwd
    phases = (
        ("forward", 0.0, t_fwd, COLORS["fwd"]),
        ("backward", t_fwd, t_bwd, COLORS["bwd"]),
        ("exposed comm (wait)", bwd_end, exposed, COLORS["exposed"]),
        ("optimizer", bwd_end + exposed, t_opt, COLORS["opt"]),
    )
    add_phase_bar(fig, phases, digits=2)


def whatif_timeline_figure(result: dict, height: int | None = None) -> go.Figure:
    """The bucket queue of one predicted step (a :func:`dtlab.model.whatif.whatif` result), times in ms from
    step start.

    Row "compute": forward, backward, the wait for exposed communication, optimizer. Then one row per
    bucket (bucket 0 = first ready) with its all-reduce as a bar and a tick where its last gradient is
    ready (backward spread over buckets by bytes). A dotted line marks the end of backward compute.
    """
    t_fwd, t_bwd, t_opt = result["t_fwd"], result["t_bwd_comp"], result["t_opt"]
    nb = np.asarray(result["bucket_nbytes"], dtype=float)
    start = np.asarray(result["start"], dtype=float)
    end = np.asarray(result["end"], dtype=float)
    ready = np.asarray(result["ready"], dtype=float)
    labels = [f"b{i} ({fmt_mib(n / MIB)} MiB)" for i, n in enumerate(nb)]
    bwd_end = t_fwd + t_bwd
    exposed = result["exposed"]
    fig = go.Figure()
    _add_compute_row(fig, t_fwd, t_bwd, exposed, t_opt)
    fig.add_trace(
        go.Bar(
            y=labels,
            x=(end - start) * 1e3,
            base=start * 1e3,
            orientation="h",
            name="all-reduce (predicted)",
            marker_color=COLORS["bucket"],
            customdata=np.column_stack([start * 1e3, end * 1e3]) if len(labels) else None,
            hovertemplate="%{y}: %{x:.3f} ms<br>from %{customdata[0]:.2f} to %{customdata[1]:.2f} ms<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            y=labels,
            x=ready * 1e3,
            mode="markers",
            name="ready",
            marker=dict(symbol="line-ns-open", size=12, color=COLORS["ready"], line=dict(width=2)),
            hovertemplate="%{y} ready at %{x:.2f} ms<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=[bwd_end * 1e3, bwd_end * 1e3],
            y=["compute", labels[-1] if labels else "compute"],
            mode="lines",
            name="backward compute ends",
            line=dict(color="#555", dash="dot"),
            hoverinfo="skip",
        )
    )
    n = len(labels)
    overlap = result["overlap"]
    ov = "no communication" if not np.isfinite(overlap) else f"overlap {overlap:.0%}"
    set_title(
        fig,
        f"Predicted bucket queue: p={result['nproc']}, {fmt_mib(result['bucket_mb'])} MiB cap, "
        f"{n} bucket{'s' if n != 1 else ''}, {result['form']} form<br>"
        f"T_step {result['t_step'] * 1e3:.1f} ms, exposed {exposed * 1e3:.1f} ms, {ov}",
    )
    fig.update_layout(
        xaxis_title="time from step start (ms)",
        yaxis_title="bucket (size in MiB)",
        barmode="overlay",
        height=height or int(min(760, 240 + 16 * n)),
        yaxis=dict(autorange="reversed", type="category", tickfont=dict(size=10 if n <= 40 else 8)),
        legend=dict(font_size=11),
    )
    return fig
