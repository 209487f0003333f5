"""Collective-level figures: the calibration (measured collectives vs the alpha-beta fit) and the
textbook vs ring all-reduce forms.

Pure functions: data in, `plotly.graph_objects.Figure` out. Nothing here imports torch or ipywidgets. The
step-level figures (predicted breakdown, bucket timeline) are in :mod:`dtlab.viz.model_plots`.

Units: data in seconds, bytes, seconds per byte (beta); on screen times are milliseconds (alpha in
microseconds), sizes bytes, bandwidth GB/s (10^9 bytes per second). Every axis names its unit.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.model import costmodel
from dtlab.model.link import one_level
from dtlab.units import fmt_bytes
from dtlab.viz.figures import COLORS, set_title

#: One colour per process count in the calibration figure (cycled when there are more).
NPROC_PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#9D755D", "#BAB0AC")

# ------------------------------------------------------------------ formatting helpers


def _bw_gbs(beta) -> float:
    """Bandwidth in GB/s for beta in seconds per byte (inf for beta <= 0)."""
    return 1.0 / beta / 1e9 if beta > 0 else float("inf")


def _fmt_gbs(x) -> str:
    return "∞" if not np.isfinite(x) else f"{x:.3g}"


def _fit_lines(fit) -> list[str]:
    """['ring fit: α = 21.3 µs [19.9, 22.8]', '1/β = 9.9 GB/s [9.6, 10.3] (95% CI)', 'rms error 3.1%']."""
    a_lo, a_hi = (x * 1e6 for x in fit.alpha_ci)
    b_lo, b_hi = fit.beta_ci
    # a bandwidth CI is the beta CI inverted: the high beta bound is the low bandwidth bound
    bw_lo, bw_hi = _bw_gbs(b_hi), _bw_gbs(b_lo)
    level = f"{fit.confidence:.0%} CI"
    return [
        f"{fit.form} fit: α = {fit.alpha * 1e6:.3g} µs [{a_lo:.3g}, {a_hi:.3g}]",
        f"1/β = {_fmt_gbs(_bw_gbs(fit.beta))} GB/s [{_fmt_gbs(bw_lo)}, {_fmt_gbs(bw_hi)}] ({level})",
        f"rms error {fit.rel_rms:.1%}",
    ]


def _fit_text(fit) -> str:
    """'ring fit: α = 21.3 µs [19.9, 22.8], 1/β = 9.9 GB/s [9.6, 10.3] (95% CI), rms error 3.1%'."""
    return ", ".join(_fit_lines(fit))


def _bytes_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Power-of-two tick values and binary-unit labels covering [lo, hi] bytes (at most ~10 ticks)."""
    lo_e = int(np.floor(np.log2(max(lo, 1.0))))
    hi_e = int(np.ceil(np.log2(max(hi, 2.0))))
    stride = max(1, int(np.ceil((hi_e - lo_e + 1) / 10)))
    if stride > 1 and stride % 2:  # keep powers of 4 (1 KiB, 4 KiB, ...) when skipping
        stride += 1
    exps = range(lo_e - lo_e % stride, hi_e + 1, stride)
    vals = [float(2**e) for e in exps]
    return vals, [fmt_bytes(v).replace(".0 ", " ") for v in vals]


# ------------------------------------------------------------------ calibration


def calibration_figure(profile, op: str | None = None) -> go.Figure:
    """Measured collective times against the fitted alpha-beta model, one column per op.

    profile: a :class:`dtlab.model.profile.Profile` (samples with op, nbytes, nproc, seconds; fits per op;
    caveats). op: one op to show, or None for every op in the profile.

    Rows, all against message size in bytes (nccl-tests convention, log axis):

    1. time per call (ms, log): the per-(size, p) median of the samples with error bars spanning the
       inter-quartile range (25th to 75th percentile), and the fitted model for each p > 1 -- solid
       inside the size range the fit used, dashed where it extrapolates. p = 1 points are shown but not
       modelled (the model predicts 0 with no peer; the fit leaves them out).
    2. model error (predicted - measured) / measured in % for each median (open markers: outside the
       fitted size range).
    3. bus bandwidth (GB/s, :func:`dtlab.model.costmodel.busbw`) of the medians and of the model, with the
       ring model's asymptote 1/beta.

    The title (per column when several ops) states the form fitted, alpha in µs and 1/beta in GB/s with
    their confidence intervals. ``profile.caveats`` and the fits' warnings are shown as a note under the
    plot.
    """
    samples = profile.samples
    ops = _ops_to_draw(profile, op)
    fig = _calibration_grid(profile, ops)
    all_p = sorted(int(p) for p in samples["nproc"].unique()) if len(samples) else []
    color = {p: NPROC_PALETTE[i % len(NPROC_PALETTE)] for i, p in enumerate(all_p)}
    shown = set()  # legend entries already shown: each name once, in the first column that draws it
    lo_all, hi_all = np.inf, 0.0
    for c, o in enumerate(ops, start=1):
        s = samples[(samples["op"] == o) & (samples["nbytes"] > 0)]
        if not s.empty:
            lo, hi = _calibration_column(fig, o, profile.fits.get(o), s, c, color, shown)
            lo_all, hi_all = min(lo_all, lo), max(hi_all, hi)
    _calibration_axes(fig, lo_all, hi_all)
    bottom = _calibration_notes(fig, profile, ops)
    fig.update_layout(height=780 + bottom - 70, margin=dict(b=bottom), legend=dict(font_size=11))
    # the column titles (up to 4 lines of 12 px) sit between the figure title and the plots
    return set_title(fig, _calibration_title(profile, ops), width=90 if len(ops) > 1 else 72, extra_top=70)


def _ops_to_draw(profile, op: str | None) -> list[str]:
    samples = profile.samples
    present = sorted(set(samples["op"].unique()) | set(profile.fits)) if len(samples) or profile.fits else []
    if op is not None and op not in present:
        raise ValueError(f"op {op!r} is not in this profile; ops present: {present}")
    ops = [op] if op is not None else present
    if not ops:
        raise ValueError("the profile has no samples and no fits to draw")
    return ops


def _calibration_grid(profile, ops: list[str]) -> go.Figure:
    """Three rows (time, model error, busbw), one column per op titled with its fit."""
    col_titles = []
    for o in ops:
        fit = profile.fits.get(o)
        # one short line each: with three ops a column is about a third of the figure wide
        col_titles.append(
            "<br>".join([f"<b>{o}</b>"] + _fit_lines(fit)) if fit else f"<b>{o}</b><br>not fitted (see notes)"
        )
    fig = make_subplots(
        rows=3,
        cols=len(ops),
        shared_xaxes=True,
        vertical_spacing=0.05,
        horizontal_spacing=0.08,
        row_heights=[0.5, 0.2, 0.3],
        subplot_titles=col_titles + [""] * (2 * len(ops)),
    )
    fig.update_annotations(font_size=12)
    return fig


def _legend_once(shown: set, name: str) -> bool:
    first = name not in shown
    shown.add(name)
    return first


def _calibration_column(fig, o: str, fit, s, c: int, color: dict, shown: set) -> tuple[float, float]:
    """Column `c`: op `o`'s samples `s` (nbytes > 0) and its fit (or None) in all three rows; the size range."""
    stats = (
        s.groupby(["nproc", "nbytes"], sort=True)["seconds"]
        .agg(
            med="median",
            q25=lambda x: x.quantile(0.25),
            q75=lambda x: x.quantile(0.75),
            lo="min",
            hi="max",
            count="count",
        )
        .reset_index()
    )
    lo = float(stats["nbytes"].min())
    hi = float(stats["nbytes"].max())
    if fit is not None:
        lo, hi = min(lo, fit.min_bytes), max(hi, fit.max_bytes)
    grid = np.geomspace(lo, hi, 160)
    if fit is not None:  # the fitted range ends are grid points, so solid and dashed pieces meet
        grid = np.unique(np.concatenate([grid, [fit.min_bytes, fit.max_bytes]]))
    for p, g in stats.groupby("nproc"):
        p = int(p)
        one = _Series(fig, c, p, color[p], shown, g["nbytes"].to_numpy(float), g["med"].to_numpy(float))
        _add_measured(one, g)
        if fit is None or p == 1:
            continue
        pred_grid = np.asarray(fit.predict(grid, p), dtype=float)
        _add_model_lines(one, fit, grid, pred_grid)
        _add_error_row(one, fit)
        _add_busbw_row(one, o, grid, pred_grid)
    if fit is not None:
        _mark_fit(fig, fit, c)
    return lo, hi


@dataclass
class _Series:
    """One rank count's medians in one column of the figure: where they are drawn (`fig`, column `c`), for which p,
    in which colour, the legend entries already shown, and the sizes `n` (bytes) with their median times `med` (s)."""

    fig: object
    c: int
    p: int
    color: str
    shown: set
    n: np.ndarray
    med: np.ndarray


def _add_measured(one: _Series, g) -> None:
    """Row 1: the medians of one p with inter-quartile error bars (`g`: their statistics per size)."""
    fig, n, med, p, c, color, shown = one.fig, one.n, one.med, one.p, one.c, one.color, one.shown
    hover = [
        f"{fmt_bytes(ni)}, p={p}<br>median {m * 1e3:.4g} ms (n={k})<br>"
        f"IQR {a * 1e3:.4g}–{b * 1e3:.4g} ms, range {x * 1e3:.4g}–{y * 1e3:.4g} ms"
        for ni, m, k, a, b, x, y in zip(n, med, g["count"], g["q25"], g["q75"], g["lo"], g["hi"])
    ]
    name = f"measured p={p}: median, bars IQR" + (" (not modelled: no peer)" if p == 1 else "")
    fig.add_trace(
        go.Scatter(
            x=n,
            y=med * 1e3,
            mode="markers",
            name=name,
            legendgroup=f"p{p}",
            showlegend=_legend_once(shown, name),
            marker=dict(color=color, size=7),
            error_y=dict(
                type="data",
                array=(g["q75"] - g["med"]).to_numpy(float) * 1e3,
                arrayminus=(g["med"] - g["q25"]).to_numpy(float) * 1e3,
                thickness=1,
            ),
            hovertext=hover,
            hoverinfo="text",
        ),
        row=1,
        col=c,
    )


def _add_model_lines(one: _Series, fit, grid, pred_grid) -> None:
    """Row 1: the model for one p, solid inside the fitted size range and dashed where it extrapolates."""
    fig, p, c, color, shown = one.fig, one.p, one.c, one.color, one.shown
    inside = (grid >= fit.min_bytes) & (grid <= fit.max_bytes)
    edge = (grid == fit.min_bytes) | (grid == fit.max_bytes)
    pieces = [("fitted range", np.where(inside, pred_grid * 1e3, np.nan), dict(width=2), "model")]
    if np.any(~inside):
        y_out = np.where(inside & ~edge, np.nan, pred_grid * 1e3)
        pieces.append(("extrapolated", y_out, dict(width=1.5, dash="dash"), "extrapolated"))
    for what, y, line, extra in pieces:
        name = f"model p={p} ({what})"
        fig.add_trace(
            go.Scatter(
                x=grid,
                y=y,
                mode="lines",
                name=name,
                legendgroup=f"p{p}",
                showlegend=_legend_once(shown, name),
                line=dict(color=color, **line),
                connectgaps=False,
                hovertemplate=f"%{{x:.3s}} B: %{{y:.4g}} ms<extra>{extra}</extra>",
            ),
            row=1,
            col=c,
        )


def _add_error_row(one: _Series, fit) -> None:
    """Row 2: (predicted - measured) / measured in % per median; open markers outside the fitted range."""
    fig, n, med, p, c, color = one.fig, one.n, one.med, one.p, one.c, one.color
    pred = np.asarray(fit.predict(n, p), dtype=float)
    rel = (pred - med) / med * 100.0
    in_fit = (n >= fit.min_bytes) & (n <= fit.max_bytes)
    fig.add_trace(
        go.Scatter(
            x=n,
            y=rel,
            mode="markers",
            name=f"error p={p}",
            legendgroup=f"p{p}",
            showlegend=False,
            marker=dict(color=color, size=7, symbol=np.where(in_fit, "circle", "circle-open")),
            hovertemplate="%{x:.3s} B: %{y:+.1f} %<extra>model error</extra>",
        ),
        row=2,
        col=c,
    )


def _add_busbw_row(one: _Series, o: str, grid, pred_grid) -> None:
    """Row 3: the bus bandwidth of op `o`'s medians (markers) and of the model (line), GB/s."""
    fig, n, med, p, c, color = one.fig, one.n, one.med, one.p, one.c, one.color
    bus_meas = np.asarray(costmodel.busbw(o, n, med, p), dtype=float) / 1e9
    ok = pred_grid > 0  # a negative fitted alpha can give t <= 0 at tiny sizes: no bandwidth there
    bus_model = np.full_like(grid, np.nan)
    bus_model[ok] = np.asarray(costmodel.busbw(o, grid[ok], pred_grid[ok], p), dtype=float) / 1e9
    for x, y, mode, name, style, extra in (
        (n, bus_meas, "markers", f"busbw p={p}", {"marker": dict(color=color, size=7)}, "measured busbw"),
        (grid, bus_model, "lines", f"model busbw p={p}", {"line": dict(color=color, width=1.5)}, "model busbw"),
    ):
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode=mode,
                name=name,
                legendgroup=f"p{p}",
                showlegend=False,
                **style,
                hovertemplate=f"%{{x:.3s}} B: %{{y:.3g}} GB/s<extra>{extra}</extra>",
            ),
            row=3,
            col=c,
        )


def _mark_fit(fig, fit, c: int) -> None:
    """Column `c`: the zero-error line, the fitted size range shaded, and the ring model's asymptote 1/beta."""
    fig.add_hline(y=0, line=dict(color="#888", width=1), row=2, col=c)
    fig.add_vrect(x0=fit.min_bytes, x1=fit.max_bytes, fillcolor="#888", opacity=0.07, line_width=0, row="all", col=c)
    if fit.form == "ring" and fit.beta > 0:  # ring busbw tends to 1/beta for every op and p
        fig.add_hline(
            y=_bw_gbs(fit.beta),
            line=dict(color="#444", width=1, dash="dot"),
            annotation_text=f"1/β = {_bw_gbs(fit.beta):.3g} GB/s",
            annotation_position="bottom right",
            annotation_font_size=10,
            row=3,
            col=c,
        )


def _calibration_axes(fig, lo_all: float, hi_all: float) -> None:
    if np.isfinite(lo_all):
        tv, tt = _bytes_ticks(lo_all, hi_all)
        fig.update_xaxes(type="log", tickvals=tv, ticktext=tt)
    else:
        fig.update_xaxes(type="log")
    fig.update_xaxes(title_text="message size (bytes, log)", row=3)
    fig.update_yaxes(type="log", title_text="time per call (ms, log)", row=1, col=1)
    fig.update_yaxes(type="log", row=1)
    fig.update_yaxes(title_text="model error (%)", row=2, col=1)
    fig.update_yaxes(title_text="busbw (GB/s)", rangemode="tozero", row=3, col=1)
    fig.update_yaxes(rangemode="tozero", row=3)


def _calibration_title(profile, ops: list[str]) -> str:
    where = ", ".join(str(profile.meta[k]) for k in ("backend", "host") if profile.meta.get(k))
    if len(ops) == 1 and ops[0] in profile.fits:
        return (
            f"Calibration{' (' + where + ')' if where else ''}: {ops[0]} (shaded: fitted size range)"
            f"<br><sup>{_fit_text(profile.fits[ops[0]])}</sup>"
        )
    forms = sorted({profile.fits[o].form for o in ops if o in profile.fits})
    return (
        f"Calibration{' (' + where + ')' if where else ''}: measured collectives vs the "
        f"{'/'.join(forms) or 'alpha-beta'} fit (shaded: fitted size range)"
    )


def _calibration_notes(fig, profile, ops: list[str]) -> int:
    """The profile's caveats and the fits' warnings under the plot; the bottom margin (px) they need."""
    notes = list(profile.caveats) + [w for o in ops if o in profile.fits for w in profile.fits[o].warnings]
    bottom = 70
    if notes:
        lines = [ln for n in notes for ln in textwrap.wrap("⚠ " + n, 110, subsequent_indent="   ")]
        # below the x-axis title: anchored at the plot's bottom edge, shifted down in pixels
        fig.add_annotation(
            text="<br>".join(lines),
            xref="paper",
            yref="paper",
            x=0,
            y=0,
            yshift=-62,
            xanchor="left",
            yanchor="top",
            showarrow=False,
            align="left",
            font=dict(size=11, color="#8a4b00"),
        )
        bottom += 10 + 16 * len(lines)
    return bottom


# ------------------------------------------------------------------ textbook vs ring


def forms_figure(link, nbytes, nproc_values) -> go.Figure:
    """Textbook vs ring all-reduce time (ms) against GPU count for one message size, side by side.

    link: a Link or a Profile (its all_reduce fit), whose alpha (s) and beta (s/B) both panels use (its own form is
    not used: each panel is one form); nbytes: message size in bytes; nproc_values: GPU counts p.
    Left panel: textbook alpha (p-1) + beta n / p; right panel: ring 2(p-1) alpha + 2(p-1)/p n beta. Each
    panel shows the latency term, the bandwidth term and their sum, with the other form's total in grey
    for reference, on a shared time axis.
    """
    lk = one_level(link)
    alpha, beta = lk.alpha, lk.beta
    p = np.array(sorted({int(x) for x in nproc_values}), dtype=float)
    if p.size == 0 or p.min() < 1:
        raise ValueError(f"nproc_values must be integers >= 1 (GPU counts), got {nproc_values!r}")
    n = float(nbytes)
    formulas = {"textbook": "textbook: α(p−1) + βn/p", "ring": "ring: 2(p−1)α + 2(p−1)/p·βn"}
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.05,
        subplot_titles=[formulas["textbook"], formulas["ring"]],
    )
    totals = {
        f: np.asarray(costmodel.collective_time("all_reduce", f, alpha, beta, n, p), dtype=float)
        for f in ("textbook", "ring")
    }
    for c, form in enumerate(("textbook", "ring"), start=1):
        a, b = costmodel.coefficients("all_reduce", form, p)
        lat = np.asarray(alpha * np.asarray(a), dtype=float) * np.ones_like(p)
        bw = np.asarray(beta * np.asarray(b) * n, dtype=float) * np.ones_like(p)
        other = "ring" if form == "textbook" else "textbook"
        for name, y, line in (
            (f"{form} total", totals[form], dict(color=COLORS["T_comm"], width=3)),
            (f"{form} latency term", lat, dict(color="#4C78A8", dash="dot")),
            (f"{form} bandwidth term", bw, dict(color="#54A24B", dash="dash")),
            (f"{other} total (reference)", totals[other], dict(color="#BBBBBB", width=1.5)),
        ):
            fig.add_trace(
                go.Scatter(
                    x=p,
                    y=y * 1e3,
                    mode="lines+markers",
                    name=name,
                    line=line,
                    legendgroup=form,
                    hovertemplate="p=%{x}: %{y:.4g} ms<extra>" + name + "</extra>",
                ),
                row=1,
                col=c,
            )
    big = p.max()
    ratio = ""
    if big > 1 and totals["textbook"][-1] > 0:
        ratio = f"; at p={int(big)} ring / textbook = {totals['ring'][-1] / totals['textbook'][-1]:.3g}×"
    fig.update_xaxes(type="log", tickvals=p, ticktext=[str(int(x)) for x in p], title_text="GPU count p (processes)")
    fig.update_yaxes(title_text="time per all-reduce (ms)", row=1, col=1)
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(height=440)
    return set_title(
        fig,
        f"All-reduce of {fmt_bytes(n)}: textbook vs ring "
        f"(α = {alpha * 1e6:.3g} µs, 1/β = {_fmt_gbs(_bw_gbs(beta))} GB/s){ratio}",
        extra_top=24,
    )
