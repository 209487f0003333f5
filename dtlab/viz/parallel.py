"""Figures of the strategies beyond data parallelism: pure functions, a run or a table in, a plotly Figure out.

- `tp_timeline(run)`: one step of a tensor-parallel rank: forward, backward and optimizer, and each all-reduce on
  the row of its layer and sublayer, with the time the rank waited for it;
- `pipeline_timeline(run)`: one step of a pipeline, stage by stage: every micro-batch's forward and backward,
  the idle gaps between them are the bubble;
- `bubble_figure(table)`: the measured bubble against M beside (P-1)/(M+P-1);
- `phase_bytes_figure(tables)`: bytes per phase and op per rank and step, run beside run (FSDP2 and ZeRO-3).

Times in ms from the step's start; bytes in MiB.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dtlab.model.parallel import bubble_fraction
from dtlab.viz.figures import COLORS, add_phase_bar, set_title


def _step(run, step):
    return max(int(run.warmup), int(run.steps["step"].max())) if step is None else int(step)


def tp_timeline(run, rank: int = 0, step: int | None = None) -> go.Figure:
    """One step on one rank of a 'tp' run (see the module docstring)."""
    step = _step(run, step)
    st = run.steps[(run.steps["rank"] == rank) & (run.steps["step"] == step)]
    if st.empty:
        return set_title(go.Figure(), f"no step {step} recorded on rank {rank}")
    row = st.iloc[0]
    fig = go.Figure()
    phases = (
        ("forward", 0.0, row["t_fwd"], COLORS["fwd"]),
        ("backward", row["t_fwd"], row["t_bwd"], COLORS["bwd"]),
        ("optimizer", row["t_fwd"] + row["t_bwd"], row["t_opt"], COLORS["opt"]),
    )
    add_phase_bar(fig, phases)
    c = run.collectives
    c = c[(c["rank"] == rank) & (c["step"] == step)].sort_values("t_start")
    labels = [
        f"layer {int(r.layer)} {r.sublayer}" if pd.notna(r.layer) else f"{r.op} ({r.axis})" for r in c.itertuples()
    ]
    order = list(dict.fromkeys(labels))
    for phase, color in (("forward", COLORS["T_comm"]), ("backward", COLORS["exposed"])):
        m = (c["phase"] == phase).to_numpy()
        if not m.any():
            continue
        g = c[m]
        fig.add_trace(
            go.Bar(
                y=[lab for lab, k in zip(labels, m) if k],
                x=(g["t_end"] - g["t_start"]) * 1e3,
                base=g["t_start"] * 1e3,
                orientation="h",
                name=f"all-reduce in {phase}",
                marker_color=color,
                customdata=g["nbytes"] / 2**20,
                hovertemplate="%{y}: %{x:.2f} ms, %{customdata:.3f} MiB<extra></extra>",
            )
        )
    fig.update_layout(
        xaxis_title="time from step start (ms)",
        barmode="overlay",
        height=240 + 24 * len(order),
        yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=["compute"] + order),
        legend=dict(orientation="h", yanchor="top", y=-0.25, x=0),
    )
    n, each = len(c[c["axis"] == "tp"]), (int(c["nbytes"].iloc[0]) if len(c) else 0)
    return set_title(
        fig, f"Tensor parallel, rank {rank}, step {step}: {n} all-reduces of {each:,} B each, on the row of their layer"
    )


def pipeline_timeline(run, step: int | None = None, dp_rank: int = 0) -> go.Figure:
    """One step of a 'pp' run (one replica): a row per stage, a bar per micro-batch's forward (F) and backward (B)."""
    step = _step(run, step)
    st = run.steps[(run.steps["step"] == step) & (run.steps.get("dp_rank", 0) == dp_rank)]
    mb = run.microbatches
    mb = mb[(mb["step"] == step) & mb["rank"].isin(st["rank"])]
    fig = go.Figure()
    stages = sorted(int(s) for s in mb["stage"].unique())
    for phase, color, tag in (("forward", COLORS["fwd"], "F"), ("backward", COLORS["bwd"], "B")):
        g = mb[mb["phase"] == phase]
        if g.empty:
            continue
        fig.add_trace(
            go.Bar(
                y=[f"stage {int(s)}" for s in g["stage"]],
                x=(g["t_end"] - g["t_start"]) * 1e3,
                base=g["t_start"] * 1e3,
                orientation="h",
                name=phase,
                marker_color=color,
                text=[f"{tag}{int(i)}" for i in g["microbatch"]],
                textposition="inside",
                insidetextanchor="middle",
                customdata=g["microbatch"],
                hovertemplate=f"{phase} of micro-batch %{{customdata}}: %{{x:.2f}} ms<extra></extra>",
            )
        )
    t_pipe = float(st["t_pipe"].max()) if len(st) else 0.0
    fig.add_vline(x=t_pipe * 1e3, line=dict(color="#555", dash="dot"))
    fig.update_layout(
        xaxis_title="time from step start (ms)",
        barmode="overlay",
        height=200 + 50 * len(stages),
        yaxis=dict(autorange="reversed"),
        legend=dict(orientation="h", yanchor="top", y=-0.3, x=0),
    )
    M, P = int(run.config.parallel.microbatches), len(stages)
    busy = (mb["t_end"] - mb["t_start"]).sum()
    measured = 1 - busy / (P * t_pipe) if t_pipe > 0 and P else float("nan")
    return set_title(
        fig,
        f"Pipeline ({run.config.parallel.schedule}), P = {P}, M = {M}, step {step}: "
        f"bubble {measured:.2f} measured, {float(bubble_fraction(max(P, 1), M)):.2f} in theory "
        "(dotted: the end of the longest stage)",
    )


def bubble_figure(table: pd.DataFrame, stages: int | None = None) -> go.Figure:
    """Measured bubble against M (median with the range over steps), one series per schedule, beside
    (P-1)/(M+P-1). `table`: :func:`dtlab.results.pipeline.bubble_table`."""
    P = int(stages or table["P"].max())
    ms = np.arange(1, max(16, int(table["M"].max())) + 1)
    fig = go.Figure(
        go.Scatter(
            x=ms,
            y=(P - 1) / (ms + P - 1),
            mode="lines",
            name=f"(P-1)/(M+P-1), P = {P}",
            line=dict(color="#555", dash="dash"),
        )
    )
    for sched, g in table.groupby("schedule"):
        g = g.sort_values("M")
        fig.add_trace(
            go.Scatter(
                x=g["M"],
                y=g["measured"],
                mode="markers+lines",
                name=f"measured, {sched}",
                error_y=dict(
                    type="data", symmetric=False, array=g["hi"] - g["measured"], arrayminus=g["measured"] - g["lo"]
                ),
                hovertemplate="M = %{x}: bubble %{y:.3f}<extra></extra>",
            )
        )
    fig.update_layout(
        xaxis_title="micro-batches M",
        yaxis_title="bubble (fraction of the step)",
        height=380,
        xaxis=dict(type="log", tickvals=[1, 2, 4, 8, 16]),
        yaxis=dict(range=[0, 1]),
        legend=dict(orientation="h", yanchor="top", y=-0.25, x=0),
    )
    return set_title(fig, "The pipeline bubble: measured (median over steps, range) against the theory")


def phase_bytes_figure(tables: dict) -> go.Figure:
    """Bytes per rank and step by phase and op, one group per run (label ->
    :func:`dtlab.results.parallel.phase_bytes`)."""
    fig = go.Figure()
    for label, t in tables.items():
        fig.add_trace(
            go.Bar(
                x=[f"{p}<br>{o}" for p, o in zip(t["phase"], t["op"])],
                y=t["bytes"] / 2**20,
                name=label,
                customdata=t["count"],
                hovertemplate="%{x}: %{y:.2f} MiB in %{customdata} calls<extra></extra>",
            )
        )
    fig.update_layout(
        barmode="group",
        yaxis_title="MiB per rank and step",
        height=380,
        legend=dict(orientation="h", yanchor="top", y=-0.3, x=0),
    )
    return set_title(fig, "Bytes per rank and step, by phase and collective")
