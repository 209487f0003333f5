"""Pure figure functions: data in, `plotly.graph_objects.Figure` out. No widgets, no torch.

Times are shown in milliseconds; every axis names its unit.
"""

from __future__ import annotations

import re

import pandas as pd
import plotly.graph_objects as go

COLORS = {
    "T_comp": "#4C78A8",
    "T_comm": "#F58518",
    "exposed": "#E45756",
    "hidden": "#72B7B2",
    "fwd": "#9ECAE9",
    "bwd": "#4C78A8",
    "opt": "#54A24B",
    "bucket": "#F58518",
    "ready": "#222222",
    "wait": "#BAB0AC",
}


def fmt_mib(nbytes) -> str:
    """Bytes in MiB with three significant digits, so a small bucket never reads as a rounded-away 0.0 or as
    another cap: fmt_mib(55688) -> '0.0531 MiB', fmt_mib(3906816) -> '3.73 MiB'."""
    return f"{float(nbytes) / 2**20:.3g} MiB"


#: Characters per title line: plotly never wraps a title, and a figure without a set width (a FigureWidget
#: in JupyterLab, a narrow notebook) is 700 px wide; 72 characters of the 16 px title font fit with room.
TITLE_WIDTH = 72
TITLE_FONT_SIZE = 16


def wrap_title(text: str, width: int = TITLE_WIDTH) -> str:
    """`text` with <br> inserted at spaces so that no line is longer than `width` characters (markup not
    counted). Existing <br> are kept; a line wrapped whole in <sup>...</sup> (smaller font) may be 1.3 times
    longer and each of its pieces keeps the tag."""
    out = []
    for seg in text.split("<br>"):
        m = re.fullmatch(r"<(sup|sub|b|i)>(.*)</\1>", seg, flags=re.S)
        tag, inner = (m.group(1), m.group(2)) if m else (None, seg)
        w = int(width * 1.3) if tag in ("sup", "sub") else width
        # measure without markup, so '<b>x</b>' counts as one character
        words, lines, cur, cur_len = inner.split(" "), [], [], 0
        for word in words:
            n = len(re.sub(r"<[^>]+>", "", word))
            if cur and cur_len + 1 + n > w:
                lines.append(" ".join(cur))
                cur, cur_len = [], 0
            cur.append(word)
            cur_len += n + (1 if cur_len else 0)
        lines.append(" ".join(cur))
        out += [f"<{tag}>{ln}</{tag}>" if tag else ln for ln in lines]
    return "<br>".join(out)


def set_title(fig: go.Figure, text: str, width: int = TITLE_WIDTH, extra_top: int = 0) -> go.Figure:
    """Give `fig` a wrapped, left-aligned title and a top margin tall enough for all of its lines (plus
    `extra_top` pixels for what sits between the title and the plot, such as subplot titles)."""
    wrapped = wrap_title(text, width)
    n = wrapped.count("<br>") + 1
    # Anchored at the figure's top: plotly places the first line's baseline at the anchor plus the pad, so
    # the pad must exceed the font's ascent or the first line is cut; later lines go downwards, and the top
    # margin is made to hold them all. (Anchored at the plot's top instead, extra lines would run down into
    # the plot: plotly does not lift a multi-line title.)
    pad = TITLE_FONT_SIZE + 8
    fig.update_layout(
        title=dict(
            text=wrapped,
            x=0,
            xanchor="left",
            xref="paper",
            y=1,
            yanchor="top",
            yref="container",
            pad=dict(t=pad),
            font=dict(size=TITLE_FONT_SIZE),
        ),
        margin=dict(t=pad + int(TITLE_FONT_SIZE * 1.35) * (n - 1) + 20 + extra_top),
    )
    return fig


def breakdown_bar(summary: pd.DataFrame, title: str = "") -> go.Figure:
    """Bars for T_step, T_comp, T_comm and exposed communication (ms), from `Run.summary()`."""
    s = summary.set_index("quantity")
    names = ["T_step", "T_comp", "T_comm", "exposed"]
    raw = [float(s.loc[n, "value"]) * 1e3 for n in names]
    vals = [v if v == v else 0.0 for v in raw]  # NaN: exposed inside the machine's noise, drawn as no bar
    colors = ["#888888", COLORS["T_comp"], COLORS["T_comm"], COLORS["exposed"]]
    hover = [str(s.loc[n, "how"]) for n in names]
    # an estimated quantity says so under its bar, not only in the hover text
    labels = [f"{n}<br>(estimated)" if h.lower().startswith("estimated") else n for n, h in zip(names, hover)]
    text = [f"{v:.0f} ms" if v == v else "below the noise" for v in raw]
    bar = dict(
        x=labels,
        y=vals,
        marker_color=colors,
        text=text,
        textposition="outside",
        cliponaxis=False,
        hovertext=hover,
        hoverinfo="text+y",
    )  # the value above the tallest bar stays whole
    if {"lo", "hi"} <= set(s.columns):  # each figure's 90% interval (dtlab.results.spread)
        lo = [float(s.loc[n, "lo"]) * 1e3 for n in names]
        hi = [float(s.loc[n, "hi"]) * 1e3 for n in names]
        bar["error_y"] = dict(
            type="data",
            symmetric=False,
            color="#444444",
            array=[h - v if h == h and r == r else 0.0 for h, v, r in zip(hi, vals, raw)],
            arrayminus=[v - x if x == x and r == r else 0.0 for x, v, r in zip(lo, vals, raw)],
        )
    fig = go.Figure(go.Bar(**bar))
    ov = float(s.loc["overlap", "value"])
    said = (
        f"overlap = {ov:.0%}"
        if ov == ov
        else "overlap not measured"
        if s.loc["overlap", "how"] == "not measured"
        else "overlap within the noise"
    )
    fig.update_layout(yaxis_title="time per step (ms)", showlegend=False, height=380)
    return set_title(
        fig,
        f"{title} step breakdown (medians, 90% intervals; {said})"
        if title
        else f"Step breakdown (medians, 90% intervals; {said})",
    )


def _add_step_phases(fig: go.Figure, row, b: pd.DataFrame) -> None:
    """Row 'compute': forward, a straggler's injected delay, backward, the wait for all-reduces, optimizer."""
    delay = row.get("straggle_s", 0.0)  # a straggler's injected sleep, part of t_bwd (dtlab.config.stragglers)
    delay = float(delay) if pd.notna(delay) else 0.0
    bwd_start, bwd_end = row["t_fwd"] + delay, row["t_fwd"] + row["t_bwd"]
    # DDP's backward ends by waiting for its all-reduces: from the last bucket's ready mark (the last gradient
    # computed) to the end of backward the rank computes nothing; drawn as a wait, not as backward compute
    last_ready = float(b["t_ready"].max()) if not b.empty else bwd_end
    wait = bwd_end - last_ready if bwd_start < last_ready < bwd_end else 0.0
    phases = [
        ("forward", 0.0, row["t_fwd"], COLORS["fwd"]),
        ("injected delay", row["t_fwd"], delay, "#B279A2"),
        ("backward", bwd_start, row["t_bwd"] - delay - wait, COLORS["bwd"]),
        ("waiting for all-reduces", bwd_end - wait, wait, COLORS["wait"]),
        ("optimizer", bwd_end, row["t_opt"], COLORS["opt"]),
    ]
    add_phase_bar(fig, phases, optional=("injected delay", "waiting for all-reduces"))


def add_phase_bar(fig: go.Figure, phases, digits: int = 1, optional=()) -> None:
    """The row 'compute' of a step timeline: one horizontal bar per phase (name, start s, duration s, color), drawn in
    ms from the step start, its hover text with `digits` decimals. A phase named in `optional` is left out when it
    lasted no time (a delay that was not injected, a wait that did not happen)."""
    for name, start, dur, color in phases:
        if dur <= 0 and name in optional:
            continue
        fig.add_trace(
            go.Bar(
                y=["compute"],
                x=[dur * 1e3],
                base=[start * 1e3],
                orientation="h",
                name=name,
                marker_color=color,
                hovertemplate=f"{name}: %{{x:.{digits}f}} ms<extra></extra>",
            )
        )


def _add_bucket_rows(fig: go.Figure, b: pd.DataFrame) -> None:
    """One row per bucket: its all-reduce as a bar, a marker where it became ready."""
    labels = [f"bucket {int(i)} ({fmt_mib(n)})" for i, n in zip(b["bucket"], b["nbytes"])]
    fig.add_trace(
        go.Bar(
            y=labels,
            x=(b["t_end"] - b["t_start"]) * 1e3,
            base=b["t_start"] * 1e3,
            orientation="h",
            name="all-reduce",
            marker_color=COLORS["bucket"],
            hovertemplate="%{y}: %{x:.1f} ms<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            y=labels,
            x=b["t_ready"] * 1e3,
            mode="markers",
            name="ready",
            marker=dict(symbol="line-ns-open", size=14, color=COLORS["ready"]),
        )
    )


def _add_collective_rows(fig: go.Figure, c: pd.DataFrame) -> int:
    """ZeRO-3: one row per op and phase, one bar per collective (start = issue time); the number of rows."""
    rows = 0
    for (op, phase), g in c.groupby(["op", "phase"], sort=False):
        label = f"{op} ({phase})"
        fig.add_trace(
            go.Bar(
                y=[label] * len(g),
                x=(g["t_end"] - g["t_start"]) * 1e3,
                base=g["t_start"] * 1e3,
                orientation="h",
                name=label,
                customdata=g["nbytes"] / 2**20,
                hovertemplate=label + ": %{x:.1f} ms, %{customdata:.2f} MiB<extra></extra>",
            )
        )
        rows += 1
    return rows


def bucket_timeline(run, rank: int = 0, step: int | None = None) -> go.Figure:
    """One step on one rank: forward, backward and optimizer as bars, each bucket's all-reduce as a bar on
    its own row, with a marker where the bucket became ready. Times in ms from the step start. The end of
    backward after the last bucket became ready, where DDP only waits for its all-reduces, is its own segment
    ("waiting for all-reduces"), not backward compute."""
    st = run.steps[run.steps["rank"] == rank]
    if st.empty:
        return set_title(go.Figure(), f"no steps recorded on rank {rank}")
    if step is None:  # the last measured step: past warm-up and DDP's bucket rebuild
        step = int(st["step"].max())
    row = st[st["step"] == step].iloc[0]
    b = run.buckets[(run.buckets["rank"] == rank) & (run.buckets["step"] == step)].sort_values("t_ready")
    c = (
        run.collectives[(run.collectives["rank"] == rank) & (run.collectives["step"] == step)]
        if not run.collectives.empty
        else run.collectives
    )
    fig = go.Figure()
    _add_step_phases(fig, row, b)
    if not b.empty:
        _add_bucket_rows(fig, b)
    rows = len(b)
    if not c.empty:
        rows += _add_collective_rows(fig, c)
    what = "collectives" if not c.empty else "all-reduces"
    fig.update_layout(
        xaxis_title="time from step start (ms)",
        barmode="overlay",
        height=220 + 22 * rows,
        yaxis=dict(autorange="reversed"),
    )
    return set_title(fig, f"Rank {rank}, step {step}: {what} against compute")


def per_step_lines(run) -> go.Figure:
    """T_step and T_comm per measured step (ms), to see warm-up and noise."""
    ps = run.per_step()
    fig = go.Figure()
    for col, name in (("t_step", "T_step"), ("t_comm", "T_comm")):
        fig.add_trace(go.Scatter(x=ps["step"], y=ps[col] * 1e3, mode="lines+markers", name=name))
    fig.update_layout(xaxis_title="step", yaxis_title="time (ms)")
    return set_title(fig, "Per-step times (slowest rank)")


def memory_bars(runs: dict) -> go.Figure:
    """Grouped bars of the bytes a rank holds (GB = 1e9 bytes) for several runs: {label: Run}.

    Parameters, gradients and optimizer state are summed from the tensors themselves; the peak is CUDA max
    allocated on GPU or the process's peak RSS on CPU (named in the legend)."""
    fig = go.Figure()
    parts = [
        ("params_bytes", "parameters"),
        ("grads_bytes", "gradients"),
        ("opt_bytes", "optimizer state"),
        ("peak_bytes", "peak"),
    ]
    for col, name in parts:
        ys, kinds = [], set()
        for run in runs.values():
            m = run.memory
            ys.append(float(m[col].max()) / 1e9 if not m.empty and m[col].notna().any() else None)
            if col == "peak_bytes" and not m.empty:
                kinds |= set(m["peak_kind"].dropna())
        label = f"{name} ({', '.join(sorted(kinds))})" if kinds else name
        fig.add_trace(go.Bar(x=list(runs), y=ys, name=label, hovertemplate="%{y:.3f} GB<extra>" + label + "</extra>"))
    fig.update_layout(barmode="group", yaxis_title="bytes per rank (GB)", height=380)
    return set_title(fig, "Memory per rank (largest rank)")


def bytes_by_op(run, step: int | None = None, rank: int | None = None) -> go.Figure:
    """Bytes moved in one step on one rank (default: the lowest rank that recorded any; an asynchronous server
    records none), per collective op and phase (MB = 1e6 bytes, nccl-tests sizes). DDP buckets count as
    all_reduce in the backward phase."""
    if rank is None:
        recorded = run.collectives if not run.collectives.empty else run.buckets
        rank = int(recorded["rank"].min()) if not recorded.empty else 0
    if not run.collectives.empty:
        c = run.collectives[run.collectives["rank"] == rank]
        if step is None:
            step = int(c["step"].max())
        d = c[c["step"] == step].groupby(["op", "phase"], as_index=False)["nbytes"].sum()
    else:
        b = run.buckets[run.buckets["rank"] == rank]
        if step is None:
            step = int(b["step"].max())
        d = pd.DataFrame(
            {"op": ["all_reduce"], "phase": ["backward"], "nbytes": [int(b[b["step"] == step]["nbytes"].sum())]}
        )
    fig = go.Figure()
    for phase, g in d.groupby("phase"):
        fig.add_trace(
            go.Bar(
                x=g["op"],
                y=g["nbytes"] / 1e6,
                name=phase,
                text=[f"{v / 1e6:,.1f} MB" for v in g["nbytes"]],
                textposition="auto",
            )
        )
    fig.update_layout(barmode="stack", yaxis_title="bytes moved per step (MB)", height=360)
    return set_title(fig, f"Bytes moved per step ({run.config.strategy}, rank {rank}, step {step})")
