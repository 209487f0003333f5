"""A real cluster's nccl-tests curve, and a calibration beside it: bus bandwidth against message size.

Pure: Profiles in, `plotly.graph_objects.Figure` out. busbw is nccl-tests' bus bandwidth (algbw x 2(p-1)/p for
all-reduce, x (p-1)/p for all-gather and reduce-scatter, GB/s = 10^9 B/s): the figure that stays comparable
across rank counts, so a 2-rank calibration and an 8-GPU box share one axis.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from dtlab.model import costmodel
from dtlab.units import fmt_bytes
from dtlab.viz.figures import set_title

#: (measured, fit) colours: the real box, then the calibration set beside it
_COLORS = (("#4C78A8", "#1F4E79"), ("#F58518", "#B35806"))


def _curve(profile, op: str):
    """(sizes in bytes, measured busbw in GB/s, p, dense sizes, the piecewise fit's busbw there) of one profile."""
    s = profile.samples[(profile.samples["op"] == op) & (profile.samples["nproc"] > 1)]
    if s.empty:
        raise ValueError(f"op {op!r} has no samples with nproc > 1 in this profile")
    p = int(s["nproc"].max())
    pts = s[s["nproc"] == p].groupby("nbytes")["seconds"].median()
    n = pts.index.to_numpy(dtype=float)
    bw = np.asarray(costmodel.busbw(op, n, pts.to_numpy(dtype=float), p), dtype=float) / 1e9
    dense = np.geomspace(n.min(), n.max(), 200)
    fit = np.asarray(costmodel.busbw(op, dense, np.asarray(profile.predict(op, dense, p), dtype=float), p)) / 1e9
    return n, bw, p, dense, fit


def _label(profile, fallback: str) -> str:
    src = profile.meta.get("source", {})
    system = src.get("system", {})
    if system:
        return f"{system.get('name', 'nccl-tests')} ({system.get('gpus')} GPUs, {system.get('interconnect')})"
    if src.get("format") == "nccl-tests":
        return f"nccl-tests, {profile.meta.get('world_size')} ranks"
    return fallback


def nccl_tests_figure(real, yours=None, op: str = "all_reduce") -> go.Figure:
    """busbw (GB/s, log) against message size (bytes, log) of `real` (a Profile from dtlab.load_nccl_tests or
    dtlab.public_nccl_tests) and, when given, `yours` (a calibration): each profile's measured sizes as markers
    (the median per size) and its piecewise alpha-beta fit as a line over the sizes it measured. The title names
    both and the ratio of their large-message bandwidths (the last regime's 1/beta)."""
    fig = go.Figure()
    lines = []
    for k, (prof, name) in enumerate(((real, "real box"), (yours, "your calibration"))):
        if prof is None:
            continue
        n, bw, p, dense, fit = _curve(prof, op)
        label = _label(prof, name) if k == 0 else f"yours ({p} ranks, {prof.meta.get('backend', '?')})"
        measured, fitted = _COLORS[k]
        fig.add_trace(
            go.Scatter(
                x=n,
                y=bw,
                mode="markers",
                name=f"{label}: measured",
                marker=dict(color=measured, size=7),
                hovertemplate="%{x:,.0f} B: %{y:.3g} GB/s<extra></extra>",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=dense,
                y=fit,
                mode="lines",
                name=f"{label}: piecewise fit",
                line=dict(color=fitted, width=2),
                hoverinfo="skip",
            )
        )
        last = (prof.segments.get(op) or [prof.fits[op]])[-1]
        lines.append((label, last))
    title = f"{op} bus bandwidth against message size: " + " vs ".join(lbl for lbl, _ in lines)
    if len(lines) == 2 and lines[0][1].beta > 0 and lines[1][1].beta > 0:
        ratio = lines[1][1].beta / lines[0][1].beta
        title += f"; large messages: the real box's 1/beta is {ratio:.3g}x yours"
    lo = min(t.x.min() for t in fig.data)
    hi = max(t.x.max() for t in fig.data)
    exps = range(int(np.floor(np.log2(lo))), int(np.ceil(np.log2(hi))) + 1, 4)
    fig.update_xaxes(
        type="log",
        title_text="message size n (bytes, log)",
        tickvals=[2.0**e for e in exps],
        ticktext=[fmt_bytes(2.0**e).replace(".0 ", " ") for e in exps],
    )
    fig.update_yaxes(type="log", title_text="busbw (GB/s, log)")
    fig.update_layout(height=480, legend=dict(orientation="h", y=-0.2, font_size=11), margin=dict(b=130))
    return set_title(fig, title)
