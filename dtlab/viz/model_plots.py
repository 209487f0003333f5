"""Model-side figures and the pure "what if" step model behind the explorer.

Pure functions: data in, `plotly.graph_objects.Figure` (or a dict / DataFrame) out. Nothing here imports
torch or ipywidgets, so the module is cheap to import and test; :mod:`dtlab.viz.dashboard` wraps these figures
in widgets.

Units: data in seconds, bytes, seconds per byte (beta); on screen times are milliseconds (alpha in
microseconds), sizes bytes or MiB, bandwidth GB/s (10^9 bytes per second). Every axis names its unit.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.model import buckets as bk
from dtlab.model import costmodel
from dtlab.viz.figures import COLORS, set_title
from dtlab.rank.data import TINY_ARCH  # a plain dict; dtlab.rank.data imports torch only inside its functions

MIB = 1024 * 1024

#: One colour per process count in the calibration figure (cycled when there are more).
NPROC_PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#9D755D", "#BAB0AC")

# ------------------------------------------------------------------ formatting helpers


def fmt_bytes(n) -> str:
    """Human-readable binary size: '512 B', '4 KiB', '25 MiB', '1.5 GiB'."""
    n = float(n)
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_mib(mb) -> str:
    """A MiB value for labels: three significant digits below 100, whole numbers above ('0.25', '24.9', '1024')."""
    mb = float(mb)
    return f"{mb:.0f}" if mb >= 100 else f"{mb:.3g}"


def config_label(nproc, bucket_mb) -> str:
    """The x label of one configuration in the breakdown figure, e.g. 'p=4, 25 MiB'."""
    return f"p={int(nproc)}, {fmt_mib(bucket_mb)} MiB"


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
    return [f"{fit.form} fit: α = {fit.alpha * 1e6:.3g} µs [{a_lo:.3g}, {a_hi:.3g}]",
            f"1/β = {_fmt_gbs(_bw_gbs(fit.beta))} GB/s [{_fmt_gbs(bw_lo)}, {_fmt_gbs(bw_hi)}] ({level})",
            f"rms error {fit.rel_rms:.1%}"]


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
    vals = [float(2 ** e) for e in exps]
    return vals, [fmt_bytes(v).replace(".0 ", " ") for v in vals]


# ------------------------------------------------------------------ calibration


def calibration_figure(profile, op: str | None = None) -> go.Figure:
    """Measured collective times against the fitted alpha-beta model, one column per op.

    profile: a :class:`dtlab.model.fit.Profile` (samples with op, nbytes, nproc, seconds; fits per op;
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
    present = sorted(set(samples["op"].unique()) | set(profile.fits)) if len(samples) or profile.fits else []
    if op is not None:
        if op not in present:
            raise ValueError(f"op {op!r} is not in this profile; ops present: {present}")
        ops = [op]
    else:
        ops = present
    if not ops:
        raise ValueError("the profile has no samples and no fits to draw")

    col_titles = []
    for o in ops:
        fit = profile.fits.get(o)
        # one short line each: with three ops a column is about a third of the figure wide
        col_titles.append("<br>".join([f"<b>{o}</b>"] + _fit_lines(fit)) if fit
                          else f"<b>{o}</b><br>not fitted (see notes)")
    titles = col_titles + [""] * (2 * len(ops))
    fig = make_subplots(rows=3, cols=len(ops), shared_xaxes=True, vertical_spacing=0.05,
                        horizontal_spacing=0.08, row_heights=[0.5, 0.2, 0.3], subplot_titles=titles)
    fig.update_annotations(font_size=12)

    all_p = sorted(int(p) for p in samples["nproc"].unique()) if len(samples) else []
    color = {p: NPROC_PALETTE[i % len(NPROC_PALETTE)] for i, p in enumerate(all_p)}
    shown = set()

    def legend_once(name: str) -> bool:
        first = name not in shown
        shown.add(name)
        return first

    lo_all, hi_all = np.inf, 0.0
    for c, o in enumerate(ops, start=1):
        fit = profile.fits.get(o)
        s = samples[(samples["op"] == o) & (samples["nbytes"] > 0)]
        if s.empty:
            continue
        stats = (s.groupby(["nproc", "nbytes"], sort=True)["seconds"]
                 .agg(med="median", q25=lambda x: x.quantile(0.25), q75=lambda x: x.quantile(0.75),
                      lo="min", hi="max", count="count").reset_index())
        lo = float(stats["nbytes"].min())
        hi = float(stats["nbytes"].max())
        if fit is not None:
            lo, hi = min(lo, fit.min_bytes), max(hi, fit.max_bytes)
        lo_all, hi_all = min(lo_all, lo), max(hi_all, hi)
        grid = np.geomspace(lo, hi, 160)
        if fit is not None:  # the fitted range ends are grid points, so solid and dashed pieces meet
            grid = np.unique(np.concatenate([grid, [fit.min_bytes, fit.max_bytes]]))
        for p, g in stats.groupby("nproc"):
            p = int(p)
            n = g["nbytes"].to_numpy(float)
            med = g["med"].to_numpy(float)
            hover = [f"{fmt_bytes(ni)}, p={p}<br>median {m * 1e3:.4g} ms (n={k})<br>"
                     f"IQR {a * 1e3:.4g}–{b * 1e3:.4g} ms, range {x * 1e3:.4g}–{y * 1e3:.4g} ms"
                     for ni, m, k, a, b, x, y in zip(n, med, g["count"], g["q25"], g["q75"], g["lo"], g["hi"])]
            name = f"measured p={p}: median, bars IQR" + (" (not modelled: no peer)" if p == 1 else "")
            fig.add_trace(go.Scatter(
                x=n, y=med * 1e3, mode="markers", name=name, legendgroup=f"p{p}",
                showlegend=legend_once(name), marker=dict(color=color[p], size=7),
                error_y=dict(type="data", array=(g["q75"] - g["med"]).to_numpy(float) * 1e3,
                             arrayminus=(g["med"] - g["q25"]).to_numpy(float) * 1e3, thickness=1),
                hovertext=hover, hoverinfo="text"), row=1, col=c)
            if fit is None or p == 1:
                continue
            pred_grid = np.asarray(fit.predict(grid, p), dtype=float)
            inside = (grid >= fit.min_bytes) & (grid <= fit.max_bytes)
            y_in = np.where(inside, pred_grid * 1e3, np.nan)
            edge = (grid == fit.min_bytes) | (grid == fit.max_bytes)
            y_out = np.where(inside & ~edge, np.nan, pred_grid * 1e3)
            name = f"model p={p} (fitted range)"
            fig.add_trace(go.Scatter(x=grid, y=y_in, mode="lines", name=name, legendgroup=f"p{p}",
                                     showlegend=legend_once(name), line=dict(color=color[p], width=2),
                                     connectgaps=False, hovertemplate="%{x:.3s} B: %{y:.4g} ms<extra>model</extra>"),
                          row=1, col=c)
            if np.any(~inside):
                name = f"model p={p} (extrapolated)"
                fig.add_trace(go.Scatter(x=grid, y=y_out, mode="lines", name=name, legendgroup=f"p{p}",
                                         showlegend=legend_once(name),
                                         line=dict(color=color[p], width=1.5, dash="dash"), connectgaps=False,
                                         hovertemplate="%{x:.3s} B: %{y:.4g} ms<extra>extrapolated</extra>"),
                              row=1, col=c)
            pred = np.asarray(fit.predict(n, p), dtype=float)
            rel = (pred - med) / med * 100.0
            in_fit = (n >= fit.min_bytes) & (n <= fit.max_bytes)
            fig.add_trace(go.Scatter(
                x=n, y=rel, mode="markers", name=f"error p={p}", legendgroup=f"p{p}", showlegend=False,
                marker=dict(color=color[p], size=7, symbol=np.where(in_fit, "circle", "circle-open")),
                hovertemplate="%{x:.3s} B: %{y:+.1f} %<extra>model error</extra>"), row=2, col=c)
            bus_meas = np.asarray(costmodel.busbw(o, n, med, p), dtype=float) / 1e9
            fig.add_trace(go.Scatter(x=n, y=bus_meas, mode="markers", name=f"busbw p={p}", legendgroup=f"p{p}",
                                     showlegend=False, marker=dict(color=color[p], size=7),
                                     hovertemplate="%{x:.3s} B: %{y:.3g} GB/s<extra>measured busbw</extra>"),
                          row=3, col=c)
            ok = pred_grid > 0  # a negative fitted alpha can give t <= 0 at tiny sizes: no bandwidth there
            bus_model = np.full_like(grid, np.nan)
            bus_model[ok] = np.asarray(costmodel.busbw(o, grid[ok], pred_grid[ok], p), dtype=float) / 1e9
            fig.add_trace(go.Scatter(x=grid, y=bus_model, mode="lines", name=f"model busbw p={p}",
                                     legendgroup=f"p{p}", showlegend=False,
                                     line=dict(color=color[p], width=1.5),
                                     hovertemplate="%{x:.3s} B: %{y:.3g} GB/s<extra>model busbw</extra>"),
                          row=3, col=c)
        if fit is not None:
            fig.add_hline(y=0, line=dict(color="#888", width=1), row=2, col=c)
            fig.add_vrect(x0=fit.min_bytes, x1=fit.max_bytes, fillcolor="#888", opacity=0.07, line_width=0,
                          row="all", col=c)
            if fit.form == "ring" and fit.beta > 0:  # ring busbw tends to 1/beta for every op and p
                fig.add_hline(y=_bw_gbs(fit.beta), line=dict(color="#444", width=1, dash="dot"),
                              annotation_text=f"1/β = {_bw_gbs(fit.beta):.3g} GB/s",
                              annotation_position="bottom right", annotation_font_size=10, row=3, col=c)

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

    where = ", ".join(str(profile.meta[k]) for k in ("backend", "host") if profile.meta.get(k))
    if len(ops) == 1 and ops[0] in profile.fits:
        title = (f"Calibration{' (' + where + ')' if where else ''}: {ops[0]} (shaded: fitted size range)"
                 f"<br><sup>{_fit_text(profile.fits[ops[0]])}</sup>")
    else:
        forms = sorted({profile.fits[o].form for o in ops if o in profile.fits})
        title = (f"Calibration{' (' + where + ')' if where else ''}: measured collectives vs the "
                 f"{'/'.join(forms) or 'alpha-beta'} fit (shaded: fitted size range)")
    notes = list(profile.caveats) + [w for o in ops if o in profile.fits for w in profile.fits[o].warnings]
    bottom = 70
    if notes:
        lines = [ln for n in notes for ln in textwrap.wrap("⚠ " + n, 110, subsequent_indent="   ")]
        text = "<br>".join(lines)
        # below the x-axis title: anchored at the plot's bottom edge, shifted down in pixels
        fig.add_annotation(text=text, xref="paper", yref="paper", x=0, y=0, yshift=-62, xanchor="left",
                           yanchor="top", showarrow=False, align="left", font=dict(size=11, color="#8a4b00"))
        bottom += 10 + 16 * len(lines)
    fig.update_layout(height=780 + bottom - 70, margin=dict(b=bottom), legend=dict(font_size=11))
    # the column titles (up to 4 lines of 12 px) sit between the figure title and the plots
    return set_title(fig, title, width=90 if len(ops) > 1 else 72, extra_top=70)


# ------------------------------------------------------------------ textbook vs ring


def forms_figure(alpha, beta, nbytes, nproc_values) -> go.Figure:
    """Textbook vs ring all-reduce time (ms) against GPU count for one message size, side by side.

    alpha: seconds; beta: seconds per byte; nbytes: message size in bytes; nproc_values: GPU counts p.
    Left panel: textbook alpha (p-1) + beta n / p; right panel: ring 2(p-1) alpha + 2(p-1)/p n beta. Each
    panel shows the latency term, the bandwidth term and their sum, with the other form's total in grey
    for reference, on a shared time axis.
    """
    p = np.array(sorted({int(x) for x in nproc_values}), dtype=float)
    if p.size == 0 or p.min() < 1:
        raise ValueError(f"nproc_values must be integers >= 1 (GPU counts), got {nproc_values!r}")
    n = float(nbytes)
    formulas = {"textbook": "textbook: α(p−1) + βn/p", "ring": "ring: 2(p−1)α + 2(p−1)/p·βn"}
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.05,
                        subplot_titles=[formulas["textbook"], formulas["ring"]])
    totals = {f: np.asarray(costmodel.collective_time("all_reduce", f, alpha, beta, n, p), dtype=float)
              for f in ("textbook", "ring")}
    for c, form in enumerate(("textbook", "ring"), start=1):
        a, b = costmodel.coefficients("all_reduce", form, p)
        lat = np.asarray(alpha * np.asarray(a), dtype=float) * np.ones_like(p)
        bw = np.asarray(beta * np.asarray(b) * n, dtype=float) * np.ones_like(p)
        other = "ring" if form == "textbook" else "textbook"
        for name, y, line in ((f"{form} total", totals[form], dict(color=COLORS["T_comm"], width=3)),
                              (f"{form} latency term", lat, dict(color="#4C78A8", dash="dot")),
                              (f"{form} bandwidth term", bw, dict(color="#54A24B", dash="dash")),
                              (f"{other} total (reference)", totals[other], dict(color="#BBBBBB", width=1.5))):
            fig.add_trace(go.Scatter(x=p, y=y * 1e3, mode="lines+markers", name=name, line=line,
                                     legendgroup=form,
                                     hovertemplate="p=%{x}: %{y:.4g} ms<extra>" + name + "</extra>"),
                          row=1, col=c)
    big = p.max()
    ratio = ""
    if big > 1 and totals["textbook"][-1] > 0:
        ratio = f"; at p={int(big)} ring / textbook = {totals['ring'][-1] / totals['textbook'][-1]:.3g}×"
    fig.update_xaxes(type="log", tickvals=p, ticktext=[str(int(x)) for x in p], title_text="GPU count p (processes)")
    fig.update_yaxes(title_text="time per all-reduce (ms)", row=1, col=1)
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(height=440)
    return set_title(fig, f"All-reduce of {fmt_bytes(n)}: textbook vs ring "
                          f"(α = {alpha * 1e6:.3g} µs, 1/β = {_fmt_gbs(_bw_gbs(beta))} GB/s){ratio}", extra_top=24)


# ------------------------------------------------------------------ what-if model


def distilbert_param_nbytes(num_labels: int = 2) -> list[int]:
    """Gradient bytes (fp32, 4 per element) of every DistilBERT-base tensor, in registration order.

    Computed from the architecture alone (no torch): DistilBertConfig defaults -- vocabulary 30522,
    dim 768, 6 layers, FFN hidden 3072, 512 positions -- plus the sequence-classification head
    (pre_classifier 768x768, classifier 768 x num_labels). Order: embeddings (word, position,
    LayerNorm weight, bias), then per layer q_lin, k_lin, v_lin, out_lin (weight, bias each),
    sa_layer_norm, ffn lin1, ffn lin2, output_layer_norm, then pre_classifier and classifier.
    104 tensors, 66,955,010 parameters = 267,820,040 bytes for num_labels=2.

    DDP's gradients become ready in roughly the *reverse* of this order: pass ``[::-1]`` to
    :func:`whatif` / :func:`dtlab.model.buckets.bucket_layout`.
    """
    return _distilbert_nbytes(num_labels)


#: The architectures of RunConfig.model, as DistilBertConfig fields: DistilBertConfig()'s defaults and
#: dtlab.rank.data's tiny preset (what the ranks build).
MODEL_ARCH = {"distilbert": dict(vocab_size=30522, dim=768, n_layers=6, hidden_dim=3072,
                                 max_position_embeddings=512),
              "tiny": {k: TINY_ARCH[k] for k in ("vocab_size", "dim", "n_layers", "hidden_dim",
                                                  "max_position_embeddings")}}


def model_param_nbytes(model: str, num_labels: int = 2) -> list[int]:
    """Gradient bytes of every tensor of a `RunConfig.model` ('distilbert' or 'tiny'), registration order,
    from the architecture alone (no torch). ``sum(...) // 4`` is the parameter count a run of that config
    reports as ``run.resolved["num_parameters"]``: labs print it instead of quoting DistilBERT's count."""
    if model not in MODEL_ARCH:
        raise ValueError(f"model must be one of {sorted(MODEL_ARCH)}, got {model!r}")
    a = MODEL_ARCH[model]
    return _distilbert_nbytes(num_labels, a["vocab_size"], a["dim"], a["n_layers"], a["hidden_dim"],
                              a["max_position_embeddings"])


def _distilbert_nbytes(num_labels=2, vocab=30522, dim=768, layers=6, hidden=3072, positions=512) -> list[int]:
    if int(num_labels) < 1:
        raise ValueError(f"num_labels must be an integer >= 1, got {num_labels!r}")

    def linear(n_in, n_out):  # torch.nn.Linear registers weight (out x in) then bias (out)
        return [n_out * n_in, n_out]

    def layer_norm(d):
        return [d, d]

    numel = [vocab * dim, positions * dim] + layer_norm(dim)
    for _ in range(layers):
        for _lin in ("q_lin", "k_lin", "v_lin", "out_lin"):
            numel += linear(dim, dim)
        numel += layer_norm(dim)        # sa_layer_norm
        numel += linear(dim, hidden)    # ffn.lin1
        numel += linear(hidden, dim)    # ffn.lin2
        numel += layer_norm(dim)        # output_layer_norm
    numel += linear(dim, dim) + linear(dim, int(num_labels))  # pre_classifier, classifier
    return [4 * n for n in numel]


def whatif(t_fwd, t_bwd_comp, t_opt, param_nbytes_in_ready_order, bucket_mb, nproc, alpha, beta,
           form: str = "ring") -> dict:
    """Predict one DDP step for a bucket size and GPU count from compute times and alpha-beta.

    t_fwd, t_bwd_comp, t_opt: forward, backward compute and optimizer seconds *per rank*. They are
    assumed independent of nproc: weak scaling, a fixed per-rank batch, so adding GPUs adds work and
    leaves each rank's compute unchanged. param_nbytes_in_ready_order: gradient bytes in the order
    they become ready (reverse registration order for DDP). bucket_mb: DDP's bucket_cap_mb (MiB).
    alpha: seconds; beta: seconds per byte; form: 'ring' or 'textbook'.

    Steps: :func:`dtlab.model.buckets.bucket_layout` with the cap in bytes (for the first bucket too, as DDP
    does when given bucket_cap_mb), per-bucket all-reduce seconds from :func:`dtlab.model.costmodel.collective_time`, ready times
    from :func:`dtlab.model.buckets.whatif_ready_times` (backward spread over buckets by bytes, an
    assumption), then :func:`dtlab.model.buckets.predict_step`.

    Returns predict_step's dict (t_comm, t_comm_end, exposed, t_step, t_comp, overlap, start, end;
    seconds) plus n_buckets, bucket_nbytes (bytes), ready and durations (seconds), and the inputs
    (t_fwd, t_bwd_comp, t_opt, bucket_mb, nproc, alpha, beta, form). With nproc = 1 every duration is
    0: no communication.
    """
    sizes = list(param_nbytes_in_ready_order)
    if not sizes or sum(sizes) <= 0:
        raise ValueError("param_nbytes_in_ready_order must list gradient sizes (bytes) with a positive total")
    cap = bk.mb_to_bytes(bucket_mb)
    layout = bk.bucket_layout(sizes, cap, first_bucket_cap_bytes=cap)  # DDP given bucket_cap_mb: no small first bucket
    nbytes = bk.bucket_sizes(sizes, layout)
    durations = np.asarray(costmodel.collective_time("all_reduce", form, alpha, beta, nbytes, nproc), dtype=float)
    durations = np.atleast_1d(durations)
    ready = bk.whatif_ready_times(t_fwd, t_bwd_comp, nbytes)
    out = bk.predict_step(t_fwd, t_bwd_comp, t_opt, ready, durations)
    out.update(n_buckets=len(layout), bucket_nbytes=nbytes, ready=ready, durations=durations,
               t_fwd=float(t_fwd), t_bwd_comp=float(t_bwd_comp), t_opt=float(t_opt), bucket_mb=float(bucket_mb),
               nproc=int(nproc), alpha=float(alpha), beta=float(beta), form=form)
    return out


def whatif_sweep(t_fwd, t_bwd_comp, t_opt, param_nbytes_in_ready_order, configs, alpha, beta,
                 form: str = "ring") -> pd.DataFrame:
    """Run :func:`whatif` for each (nproc, bucket_mb) in `configs`; one row per configuration.

    Same units and assumptions as :func:`whatif` (per-rank compute independent of nproc). Columns:
    label (:func:`config_label`), nproc, bucket_mb (MiB), n_buckets, t_comp, t_comm, exposed, t_step
    (seconds) and overlap (fraction; NaN without communication). Ready for
    :func:`predicted_breakdown_figure`.
    """
    rows = []
    for nproc, bucket_mb in configs:
        r = whatif(t_fwd, t_bwd_comp, t_opt, param_nbytes_in_ready_order, bucket_mb, nproc, alpha, beta, form)
        rows.append({"label": config_label(nproc, bucket_mb), "nproc": int(nproc), "bucket_mb": float(bucket_mb),
                     "n_buckets": r["n_buckets"], "t_comp": r["t_comp"], "t_comm": r["t_comm"],
                     "exposed": r["exposed"], "t_step": r["t_step"], "overlap": r["overlap"]})
    return pd.DataFrame(rows, columns=["label", "nproc", "bucket_mb", "n_buckets", "t_comp", "t_comm",
                                       "exposed", "t_step", "overlap"])


def compute_from_run(run) -> dict:
    """Per-rank compute seconds (t_fwd, t_bwd_comp, t_opt) of a measured DDP run, for :func:`whatif`.

    With a no-op comm hook baseline (``run.baseline_steps``) the medians over baseline steps (slowest
    rank per step) are used: compute with no communication at all. Without one, backward compute is
    *estimated* from the measured steps as the time until the last bucket was ready. The dict's
    ``source`` says which.
    """
    base = run.baseline_steps
    if base is not None and not base.empty:
        slow = base.loc[base.groupby("step")["t_step"].idxmax()]
        return {"t_fwd": float(slow["t_fwd"].median()), "t_bwd_comp": float(slow["t_bwd"].median()),
                "t_opt": float(slow["t_opt"].median()),
                "source": f"measured: no-op comm hook baseline of {run.path} ({len(slow)} steps, median)"}
    ps = run.measured_steps()
    if ps.empty:
        raise ValueError(f"run {run.path} has no measured steps to take compute times from")
    slow = ps.loc[ps.groupby("step")["t_step"].idxmax()]
    t_bwd = []
    for row in slow.itertuples():
        b = run.buckets[(run.buckets["rank"] == row.rank) & (run.buckets["step"] == row.step)] \
            if not run.buckets.empty else run.buckets
        t_bwd.append(float(b["t_ready"].max()) - row.t_fwd if not b.empty else row.t_bwd)
    return {"t_fwd": float(slow["t_fwd"].median()), "t_bwd_comp": float(np.median(t_bwd)),
            "t_opt": float(slow["t_opt"].median()),
            "source": f"estimated from {run.path}: backward until the last bucket was ready (no baseline)"}


# ------------------------------------------------------------------ breakdown and timeline


def predicted_breakdown_figure(df: pd.DataFrame, measured: pd.DataFrame | None = None,
                               highlight: str | None = None, title: str | None = None) -> go.Figure:
    """Predicted step breakdown per configuration: stacked T_comp + exposed communication (ms).

    df: one row per configuration with columns label (x, e.g. 'p=4, 25 MiB'), t_comp, t_comm, exposed
    (seconds), e.g. from :func:`whatif_sweep`. The bar height is the predicted T_step; T_comm (all of
    the communication, hidden or not) is drawn as a diamond marker line.

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
    fig.add_trace(go.Bar(x=labels, y=t_comp, name="T_comp (predicted)", marker_color=COLORS["T_comp"],
                         marker_line=dict(width=outline, color="#111"),
                         hovertemplate="%{x}<br>T_comp %{y:.2f} ms<extra></extra>"))
    fig.add_trace(go.Bar(x=labels, y=exposed, name="exposed comm (predicted)", marker_color=COLORS["exposed"],
                         marker_line=dict(width=outline, color="#111"),
                         customdata=np.column_stack([t_comp + exposed, t_comm]) if len(labels) else None,
                         hovertemplate=("%{x}<br>exposed %{y:.2f} ms<br>T_step %{customdata[0]:.2f} ms"
                                        "<br>T_comm %{customdata[1]:.2f} ms<extra></extra>")))
    fig.add_trace(go.Scatter(x=labels, y=t_comm, name="T_comm (predicted, hidden + exposed)", mode="lines+markers",
                             marker=dict(symbol="diamond", size=10, color=COLORS["T_comm"]),
                             line=dict(color=COLORS["T_comm"], width=1, dash="dot"),
                             hovertemplate="%{x}<br>T_comm %{y:.2f} ms<extra></extra>"))
    if measured is not None:
        if "label" not in measured.columns or "t_step" not in measured.columns:
            raise ValueError("measured needs columns label and t_step (seconds); t_comm, t_comp are optional")
        style = {"t_step": ("measured T_step", dict(symbol="x", size=12, color="#111")),
                 "t_comm": ("measured T_comm", dict(symbol="diamond-open", size=12, color=COLORS["T_comm"],
                                                    line=dict(width=2))),
                 # gold, not the T_comp bar's blue: drawn on that bar, a blue mark would be invisible
                 "t_comp": ("measured T_comp", dict(symbol="line-ew-open", size=30, color="#F2C12E",
                                                    line=dict(width=4)))}
        for col, (name, marker) in style.items():
            if col not in measured.columns:
                continue
            fig.add_trace(go.Scatter(x=measured["label"].astype(str).tolist(),
                                     y=measured[col].to_numpy(float) * 1e3, mode="markers", name=name,
                                     marker=marker, hovertemplate="%{x}<br>" + name + " %{y:.2f} ms<extra></extra>"))
    set_title(fig, title or "Predicted step time: compute + exposed communication")
    fig.update_layout(barmode="stack",
                      xaxis_title="configuration (GPU count p, bucket size in MiB)",
                      yaxis_title="time per step (ms)", height=420, legend=dict(font_size=11),
                      xaxis=dict(type="category", categoryorder="array", categoryarray=labels))
    return fig


def whatif_timeline_figure(result: dict, height: int | None = None) -> go.Figure:
    """The bucket queue of one predicted step (a :func:`whatif` result), times in ms from step start.

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
    for name, s, d, color in (("forward", 0.0, t_fwd, COLORS["fwd"]), ("backward", t_fwd, t_bwd, COLORS["bwd"]),
                              ("exposed comm (wait)", bwd_end, exposed, COLORS["exposed"]),
                              ("optimizer", bwd_end + exposed, t_opt, COLORS["opt"])):
        fig.add_trace(go.Bar(y=["compute"], x=[d * 1e3], base=[s * 1e3], orientation="h", name=name,
                             marker_color=color, hovertemplate=f"{name}: %{{x:.2f}} ms<extra></extra>"))
    fig.add_trace(go.Bar(y=labels, x=(end - start) * 1e3, base=start * 1e3, orientation="h",
                         name="all-reduce (predicted)", marker_color=COLORS["bucket"],
                         customdata=np.column_stack([start * 1e3, end * 1e3]) if len(labels) else None,
                         hovertemplate="%{y}: %{x:.3f} ms<br>from %{customdata[0]:.2f} to %{customdata[1]:.2f} ms"
                                       "<extra></extra>"))
    fig.add_trace(go.Scatter(y=labels, x=ready * 1e3, mode="markers", name="ready",
                             marker=dict(symbol="line-ns-open", size=12, color=COLORS["ready"], line=dict(width=2)),
                             hovertemplate="%{y} ready at %{x:.2f} ms<extra></extra>"))
    fig.add_trace(go.Scatter(x=[bwd_end * 1e3, bwd_end * 1e3], y=["compute", labels[-1] if labels else "compute"],
                             mode="lines", name="backward compute ends", line=dict(color="#555", dash="dot"),
                             hoverinfo="skip"))
    n = len(labels)
    overlap = result["overlap"]
    ov = "no communication" if not np.isfinite(overlap) else f"overlap {overlap:.0%}"
    set_title(fig, f"Predicted bucket queue: p={result['nproc']}, {fmt_mib(result['bucket_mb'])} MiB cap, "
                   f"{n} bucket{'s' if n != 1 else ''}, {result['form']} form<br>"
                   f"T_step {result['t_step'] * 1e3:.1f} ms, exposed {exposed * 1e3:.1f} ms, {ov}")
    fig.update_layout(
        xaxis_title="time from step start (ms)", yaxis_title="bucket (size in MiB)",
        barmode="overlay", height=height or int(min(760, 240 + 16 * n)),
        yaxis=dict(autorange="reversed", type="category", tickfont=dict(size=10 if n <= 40 else 8)),
        legend=dict(font_size=11))
    return fig
