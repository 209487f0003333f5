"""Pure figures for stragglers: who waited for whom. Data in (`dtlab.results.stragglers` frames), `go.Figure` out;
ms on screen."""

from __future__ import annotations

import pandas as pd
import plotly.colors
import plotly.graph_objects as go

from dtlab.results.stragglers import sync_step_model, wait_summary
from dtlab.viz.figures import COLORS, set_title

STRAGGLE_COLOR = "#B279A2"
WAIT_COLOR = COLORS["exposed"]


def _who(row, model_wait_s: float) -> str:
    if pd.isna(row.waited_for):  # the rank was itself the last to join: it waited for nobody
        return f"rank {int(row.rank)} waited for nobody (model {model_wait_s * 1e3:.0f} ms)"
    return (
        f"rank {int(row.rank)} waited {row.wait_s * 1e3:.0f} ms for rank {int(row.waited_for)} "
        f"(model {model_wait_s * 1e3:.0f} ms)"
    )


def who_waited(waits: pd.DataFrame, title: str = "") -> go.Figure:
    """One horizontal bar per rank, medians over the steps of a `dtlab.results.stragglers.rank_waits` frame: its compute
    (without the injected delay), the injected delay and its measured wait for the slowest peer, stacked, in
    ms. The synchronous-step model (`sync_step_model` on the measured compute) says every bar ends at the
    slowest rank's compute: a dotted line there, and each rank's model wait beside its measured one."""
    s = wait_summary(waits)
    if s.empty:
        return set_title(go.Figure(), "no recorded bucket waits (stragglers need record=True and strategy 'ddp')")
    labels = [f"rank {int(r)}" for r in s["rank"]]
    comp = s["t_comp_s"] - s["straggle_s"]
    fig = go.Figure()
    for name, vals, base, color in (
        ("compute", comp, comp * 0.0, COLORS["T_comp"]),
        ("injected delay", s["straggle_s"], comp, STRAGGLE_COLOR),
        ("waiting for the slowest peer", s["wait_s"], s["t_comp_s"], WAIT_COLOR),
    ):
        fig.add_trace(
            go.Bar(
                y=labels,
                x=vals * 1e3,
                base=base * 1e3,
                orientation="h",
                name=name,
                marker_color=color,
                hovertemplate=f"{name}: %{{x:.1f}} ms<extra></extra>",
            )
        )
    model = sync_step_model(dict(zip(s["rank"], s["t_comp_s"])))
    fig.add_vline(
        x=float(model["t_step_s"].iloc[0]) * 1e3,
        line_dash="dot",
        line_color="#222222",
        annotation_text="model: slowest rank's compute",
        annotation_position="top",
    )
    for label, row, mw in zip(labels, s.itertuples(), model["wait_s"]):
        fig.add_annotation(
            y=label,
            x=float(row.t_comp_s + row.wait_s) * 1e3,
            text=_who(row, float(mw)),
            xanchor="left",
            showarrow=False,
            xshift=6,
            font=dict(size=11),
        )
    end_ms = float((s["t_comp_s"] + s["wait_s"]).max()) * 1e3
    fig.update_layout(
        barmode="overlay",
        yaxis=dict(autorange="reversed"),
        height=200 + 45 * len(s),
        xaxis=dict(title=f"time per step (ms), medians over {int(s['steps'].max())} steps", range=[0, 1.7 * end_ms]),
    )  # room on the right for the sentences
    head = f"Who waited for whom ({title})" if title else "Who waited for whom"
    return set_title(
        fig,
        f"{head}<br><sup>A synchronous step waits for the slowest rank: "
        "wait_i = max_j T_comp,j - T_comp,i (T_comp with the injected delay)</sup>",
    )


def wait_per_step(waits: pd.DataFrame) -> go.Figure:
    """Each rank's wait (solid) and injected delay (dashed, where non-zero) per step, in ms, one colour per rank:
    a rank waits for the slowest peer's compute beyond its own, step after step."""
    fig = go.Figure()
    palette = px_colors()
    for i, (rank, g) in enumerate(waits.groupby("rank")):
        color = palette[i % len(palette)]
        fig.add_trace(
            go.Scatter(
                x=g["step"], y=g["wait_s"] * 1e3, mode="lines+markers", name=f"rank {rank} wait", line=dict(color=color)
            )
        )
        if (g["straggle_s"].fillna(0) > 0).any():
            fig.add_trace(
                go.Scatter(
                    x=g["step"],
                    y=g["straggle_s"] * 1e3,
                    mode="lines",
                    name=f"rank {rank} injected delay",
                    line=dict(dash="dash", color=color),
                )
            )
    fig.update_layout(xaxis=dict(title="step", dtick=1), yaxis_title="time (ms)", height=360)
    return set_title(
        fig,
        "Wait per step (solid) and injected delay (dashed): each rank waits for the slowest "
        "peer's compute beyond its own",
    )


def px_colors() -> list[str]:
    """Plotly's default qualitative palette (the colours traces get when none is set)."""
    return list(plotly.colors.qualitative.Plotly)
