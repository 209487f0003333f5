"""A self-contained HTML report of a Kineto trace (dtlab.results.kineto): the breakdown per rank and step, the
collectives table, and a timeline of one step per rank (compute and communication intervals), like `dtlab show`'s
report for runs."""

from __future__ import annotations

import html
import os

import plotly.graph_objects as go

from dtlab.results.kineto.ranks import COMM, COMP
from dtlab.viz.figures import set_title


def trace_timeline(trace, step: int | None = None, max_bars: int = 4000) -> go.Figure:
    """One profiler step (default: the last non-baseline one of the first rank) on every rank: compute and
    communication intervals as bars, times in ms from the step's start on each rank."""
    fig = go.Figure()
    steps = trace.steps
    if steps.empty:
        return set_title(fig, "no ProfilerStep in the trace: no timeline")
    if step is None:
        train = steps[~steps["baseline"]]
        step = int((train if not train.empty else steps)["step"].iloc[-1])
    for r in trace.ranks:
        s = r.steps[r.steps["step"] == step]
        if s.empty:
            continue
        t0 = float(s["t_start"].iloc[0])
        for kind, label, color in ((COMP, "compute", "#4C78A8"), (COMM, "communication", "#F58518")):
            m = (r.act_step == step) & (r.act_kind == kind)
            st, en = r.act_start[m][:max_bars], r.act_end[m][:max_bars]
            fig.add_trace(
                go.Bar(
                    y=[f"rank {r.rank} {label}"] * len(st),
                    x=(en - st) * 1e3,
                    base=(st - t0) * 1e3,
                    orientation="h",
                    marker_color=color,
                    name=f"rank {r.rank} {label}",
                    showlegend=False,
                    hovertemplate=label + ": %{x:.3f} ms<extra></extra>",
                )
            )
    fig.update_layout(
        xaxis_title="time from the step's start (ms)",
        barmode="overlay",
        height=200 + 44 * len(trace.ranks),
        yaxis={"autorange": "reversed"},
    )
    return set_title(fig, f"Step {step}: compute and communication on every rank")


def write_trace_report(trace, path: str) -> str:
    """Write the summary text, the breakdown table and the timeline to one HTML file; return its path."""
    fig = trace_timeline(trace)
    b = trace.breakdown()
    for col in ("T_step", "T_comp", "T_comm", "exposed", "idle"):
        b[col + "_ms"] = b.pop(col) * 1e3
    body = (
        f"<h1>dtlab trace</h1><pre>{html.escape(trace.summary_text())}</pre>"
        + b.to_html(index=False, float_format=lambda v: f"{v:.4g}")
        + fig.to_html(full_html=False, include_plotlyjs=True)
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(
            "<!doctype html><html><head><meta charset='utf-8'><title>dtlab trace</title></head>"
            f"<body style='font-family:sans-serif'>{body}</body></html>"
        )
    return path
