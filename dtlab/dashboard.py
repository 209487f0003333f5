"""The interactive explorer: sliders over the alpha-beta DDP step model, two live figures.

Widgets and wiring only. The model and the figures are the pure functions of :mod:`dtlab.model_figures`;
a slider move re-evaluates that model (it never launches a run) and copies the new figures into the
existing `plotly.graph_objects.FigureWidget`s inside ``batch_update()``, so the browser receives one
update per figure.

    from dtlab.dashboard import explorer
    explorer()                                    # defaults: labelled, not calibrated
    explorer(profile=load_profile("profiles/x"), compute=compute_from_run(run), measured=sweep_df)
"""

from __future__ import annotations

import html
import time

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go

from . import model_figures as mf

#: Defaults when no profile is given: plausible for one NVLink/InfiniBand-class ring, *not calibrated*.
DEFAULT_ALPHA_S = 20e-6
DEFAULT_BANDWIDTH_GBS = 10.0
#: Placeholder DistilBERT compute per rank (seconds) when no `compute` is given: a rough guess for batch
#: 32 x 128 tokens on one data-center GPU, *not measured*. Pass `compute=compute_from_run(run)` instead.
DEFAULT_COMPUTE = {"t_fwd": 0.010, "t_bwd_comp": 0.020, "t_opt": 0.003}
DEFAULT_COMPUTE_SOURCE = ("placeholder, not measured: a rough guess for DistilBERT, batch 32 x 128 tokens "
                          "per rank on one data-center GPU")
DEFAULT_BUCKET_MB = 25.0
#: x values of the breakdown figure (the current slider value is always added).
SWEEP_NPROC = (1, 2, 4, 8, 16, 32, 64)
SWEEP_BUCKET_MB = (0.25, 1.0, 5.0, 25.0, 100.0, 400.0, 1024.0)
#: a measured row matches the slider's bucket size within this relative tolerance (log sliders snap)
BUCKET_MATCH_RTOL = 0.02
MEASURED_COLUMNS = ("nproc", "bucket_mb", "t_step")


def _log_slider(value, lo_exp, hi_exp, base, step, description, fmt) -> widgets.FloatLogSlider:
    """A FloatLogSlider whose range is widened, if needed, to contain `value`."""
    e = float(np.log(value) / np.log(base))
    lo_exp, hi_exp = min(lo_exp, np.floor(e)), max(hi_exp, np.ceil(e))
    return widgets.FloatLogSlider(value=value, base=base, min=lo_exp, max=hi_exp, step=step,
                                  description=description, readout_format=fmt, continuous_update=True,
                                  style={"description_width": "150px"}, layout=widgets.Layout(width="480px"))


class Explorer(widgets.VBox):
    """The explorer widget returned by :func:`explorer`.

    Attributes for notebooks and tests:
      sliders        dict of the controls: nproc, bucket_mb, alpha_us, bandwidth_gbs, form, sweep
      figures        dict of FigureWidgets: breakdown, timeline
      result         the latest :func:`dtlab.model_figures.whatif` dict (current setting)
      sweep          the latest :func:`dtlab.model_figures.whatif_sweep` DataFrame (breakdown figure)
      last_redraw_s  seconds the latest redraw took (model + figure update in this kernel; the browser's
                     own rendering comes on top and is not measured)
      redraw_times   every redraw's seconds, oldest first (the first is the warm-up redraw at build time)
    """

    def __init__(self, profile=None, compute=None, measured=None, param_nbytes=None):
        notes = []
        # ---- alpha, beta: the profile's all_reduce fit, else labelled defaults
        self._fits = {}
        if profile is not None:
            self._fits = _all_reduce_fits(profile)
        form0 = profile.fits["all_reduce"].form if profile is not None and "all_reduce" in profile.fits else "ring"
        if form0 in self._fits:
            alpha, beta = self._fits[form0]
            self._ab_source = f"profile fit ({form0})"
        else:
            alpha, beta = DEFAULT_ALPHA_S, 1.0 / (DEFAULT_BANDWIDTH_GBS * 1e9)
            self._ab_source = "default, not calibrated"
            if profile is not None:
                notes.append("the profile has no usable all_reduce fit (missing, or alpha/beta not positive): "
                             "using defaults")
        if profile is not None and profile.caveats:
            notes += [f"profile caveat: {c}" for c in profile.caveats]

        # ---- compute per rank
        compute = dict(compute) if compute is not None else dict(DEFAULT_COMPUTE, source=DEFAULT_COMPUTE_SOURCE)
        for k in ("t_fwd", "t_bwd_comp", "t_opt"):
            if k not in compute or not np.isfinite(compute[k]) or compute[k] < 0:
                raise ValueError(f"compute must give {k} in seconds (finite, >= 0); got {compute.get(k)!r}")
        self._compute = compute
        compute_source = compute.get("source", "given by the caller")

        # ---- gradient sizes in ready order
        if param_nbytes is None:
            self._sizes = mf.distilbert_param_nbytes()[::-1]
            sizes_source = "DistilBERT-base (66,955,010 fp32 parameters), reverse registration order"
        else:
            self._sizes = [int(x) for x in param_nbytes]
            if not self._sizes or sum(self._sizes) <= 0:
                raise ValueError("param_nbytes must list gradient sizes in bytes (ready order) with a positive total")
            sizes_source = f"{len(self._sizes)} tensors given by the caller ({mf.fmt_bytes(sum(self._sizes))})"

        # ---- measured sweep to overlay
        self._measured = None
        if measured is not None:
            missing = [c for c in MEASURED_COLUMNS if c not in measured.columns]
            if missing:
                raise ValueError(f"measured is missing columns {missing}; needs nproc, bucket_mb, t_step "
                                 "(seconds), optionally t_comm, t_comp")
            # a sweep's skipped or failed rows have no times: nothing to draw
            self._measured = measured[measured["t_step"].notna()].reset_index(drop=True)

        # ---- controls; GPU count starts at the largest p the profile measured (where it is calibrated)
        nproc0 = 8
        if profile is not None and len(profile.samples):
            nproc0 = int(np.clip(profile.samples["nproc"].max(), 1, 64))
        self.sliders = {
            "nproc": widgets.IntSlider(value=nproc0, min=1, max=64, step=1, description="GPU count p",
                                       continuous_update=True, style={"description_width": "150px"},
                                       layout=widgets.Layout(width="480px")),
            "bucket_mb": _log_slider(DEFAULT_BUCKET_MB, -7, 10, 2, 0.05, "bucket size (MiB)", ".3g"),
            "alpha_us": _log_slider(alpha * 1e6, -1, 4, 10, 0.02, "α latency (µs)", ".3g"),
            "bandwidth_gbs": _log_slider(1.0 / beta / 1e9, -2, 3, 10, 0.02, "1/β bandwidth (GB/s)", ".3g"),
            "form": widgets.ToggleButtons(options=["ring", "textbook"], value=form0, description="model form",
                                          style={"description_width": "150px", "button_width": "90px"}),
            "sweep": widgets.ToggleButtons(options=[("GPU count", "nproc"), ("bucket size", "bucket_mb")],
                                           value="nproc", description="bars across",
                                           style={"description_width": "150px", "button_width": "90px"}),
        }
        self._source_label = widgets.HTML()
        self.redraw_label = widgets.Label("redraw – ms")
        self.result = None
        self.sweep = None
        self.last_redraw_s = None
        self.redraw_times: list[float] = []
        self._hold = False

        # ---- figures: built once from the pure functions, then updated in place
        self._compute_model()
        self.figures = {
            "breakdown": go.FigureWidget(self._breakdown_fig()),
            "timeline": go.FigureWidget(mf.whatif_timeline_figure(self.result, height=self._timeline_height())),
        }
        for name in ("nproc", "bucket_mb", "alpha_us", "bandwidth_gbs", "sweep"):
            self.sliders[name].observe(self._on_change, names="value")
        self.sliders["form"].observe(self._on_form, names="value")
        for name in ("alpha_us", "bandwidth_gbs"):
            self.sliders[name].observe(self._on_manual_ab, names="value")

        c_ms = {k: compute[k] * 1e3 for k in ("t_fwd", "t_bwd_comp", "t_opt")}
        info = [f"<b>compute per rank</b>: fwd {c_ms['t_fwd']:.3g} ms, bwd {c_ms['t_bwd_comp']:.3g} ms, "
                f"opt {c_ms['t_opt']:.3g} ms ({html.escape(compute_source)}); assumed independent of p "
                "(fixed per-rank batch)",
                f"<b>gradients</b>: {html.escape(sizes_source)}; backward assumed spread over buckets by bytes",
                "<b>measured</b>: " + ("none" if self._measured is None else
                                       f"{len(self._measured)} rows, shown where p and bucket size match")]
        self._static_info = "<br>".join(info + [f"<span style='color:#8a4b00'>⚠ {html.escape(n)}</span>"
                                                for n in notes])
        self._update_source_label()
        controls = widgets.VBox([self.sliders["nproc"], self.sliders["bucket_mb"], self.sliders["alpha_us"],
                                 self.sliders["bandwidth_gbs"], self.sliders["form"], self.sliders["sweep"],
                                 self.redraw_label])
        super().__init__(children=[self._source_label, controls, self.figures["breakdown"],
                                   self.figures["timeline"]])
        self.redraw()  # warms plotly's update path, so the first slider move is as fast as the rest

    # ------------------------------------------------------------ model
    def params(self) -> dict:
        """The current setting in model units: nproc, bucket_mb (MiB), alpha (s), beta (s/byte), form."""
        s = self.sliders
        return {"nproc": int(s["nproc"].value), "bucket_mb": float(s["bucket_mb"].value),
                "alpha": float(s["alpha_us"].value) * 1e-6, "beta": 1.0 / (float(s["bandwidth_gbs"].value) * 1e9),
                "form": s["form"].value}

    def _configs(self, p: dict) -> list[tuple[int, float]]:
        """(nproc, bucket_mb) pairs of the breakdown figure: the sweep grid, the current setting and any
        matching measured configuration; one per label, the current setting winning a label clash."""
        cur = (p["nproc"], p["bucket_mb"])
        if self.sliders["sweep"].value == "nproc":
            values = set(SWEEP_NPROC) | {cur[0]} | set(self._matching_measured(p)["nproc"].astype(int))
            cands = [(n, cur[1]) for n in sorted(values)]
        else:
            values = set(SWEEP_BUCKET_MB) | set(self._matching_measured(p)["bucket_mb"].astype(float))
            cands = [(cur[0], b) for b in sorted(values)]
            cands = sorted(
                [c for c in cands if mf.config_label(*c) != mf.config_label(*cur)] + [cur], key=lambda c: c[1])
        seen, out = set(), []
        for c in cands:
            lab = mf.config_label(*c)
            if lab not in seen:
                seen.add(lab)
                out.append(c)
        return out

    def _matching_measured(self, p: dict) -> pd.DataFrame:
        """Measured rows comparable with the breakdown figure's x axis at setting `p`."""
        m = self._measured
        if m is None:
            return pd.DataFrame(columns=list(MEASURED_COLUMNS))
        if self.sliders["sweep"].value == "nproc":
            return m[np.isclose(m["bucket_mb"].astype(float), p["bucket_mb"], rtol=BUCKET_MATCH_RTOL)]
        return m[m["nproc"].astype(int) == p["nproc"]]

    def _measured_overlay(self, p: dict) -> pd.DataFrame | None:
        """The matching measured rows relabelled to the figure's x labels (None without measurements)."""
        if self._measured is None:
            return None
        cols = ["label"] + [c for c in ("t_step", "t_comm", "t_comp") if c in self._measured.columns]
        m = self._matching_measured(p)
        if m.empty:
            return pd.DataFrame({c: pd.Series(dtype=object if c == "label" else float) for c in cols})
        if self.sliders["sweep"].value == "nproc":  # snapped to the slider's bucket size (within tolerance)
            labels = [mf.config_label(n, p["bucket_mb"]) for n in m["nproc"]]
        else:
            labels = [mf.config_label(p["nproc"], b) for b in m["bucket_mb"]]
        out = m.assign(label=labels)
        return out[cols]

    def _compute_model(self) -> None:
        p = self.params()
        c = self._compute
        self.result = mf.whatif(c["t_fwd"], c["t_bwd_comp"], c["t_opt"], self._sizes, p["bucket_mb"], p["nproc"],
                                p["alpha"], p["beta"], p["form"])
        self.sweep = mf.whatif_sweep(c["t_fwd"], c["t_bwd_comp"], c["t_opt"], self._sizes, self._configs(p),
                                     p["alpha"], p["beta"], p["form"])

    def _breakdown_fig(self) -> go.Figure:
        p = self.params()
        across = "GPU count" if self.sliders["sweep"].value == "nproc" else "bucket size"
        title = (f"Predicted step across {across} ({p['form']}, α = {p['alpha'] * 1e6:.3g} µs, "
                 f"1/β = {1 / p['beta'] / 1e9:.3g} GB/s); outlined: current setting")
        return mf.predicted_breakdown_figure(self.sweep, self._measured_overlay(p),
                                             highlight=mf.config_label(p["nproc"], p["bucket_mb"]), title=title)

    def _timeline_height(self) -> int:
        return int(min(760, 260 + 14 * len(self._sizes)))  # fixed, so the page does not jump as buckets change

    # ------------------------------------------------------------ callbacks
    def redraw(self, change=None) -> None:
        """Recompute the model for the current sliders and update both figures in place (timed)."""
        t0 = time.perf_counter()
        self._compute_model()
        _sync(self.figures["breakdown"], self._breakdown_fig())
        _sync(self.figures["timeline"], mf.whatif_timeline_figure(self.result, height=self._timeline_height()))
        dt = time.perf_counter() - t0
        self.last_redraw_s = dt
        self.redraw_times.append(dt)
        self.redraw_label.value = f"redraw {dt * 1e3:.0f} ms (model + figure update, this kernel)"

    def _on_change(self, change) -> None:
        if not self._hold:
            self.redraw()

    def _on_manual_ab(self, change) -> None:
        if not self._hold:
            self._ab_source = "set by hand"
            self._update_source_label()

    def _on_form(self, change) -> None:
        """Switching the form loads that form's profile fit (when there is one) before redrawing: alpha and
        beta fitted under one form do not carry over to the other."""
        form = change["new"]
        if form in self._fits:
            alpha, beta = self._fits[form]
            self._hold = True
            try:
                _set_log_value(self.sliders["alpha_us"], alpha * 1e6)
                _set_log_value(self.sliders["bandwidth_gbs"], 1.0 / beta / 1e9)
            finally:
                self._hold = False
            self._ab_source = f"profile fit ({form})"
        elif self._ab_source.startswith("profile fit"):
            self._ab_source = f"{self._ab_source}, reused under {form} (not refitted)"
        self._update_source_label()
        self.redraw()

    def _update_source_label(self) -> None:
        self._source_label.value = (f"<div style='font-size:90%;line-height:1.35'><b>α, β</b>: "
                                    f"{html.escape(self._ab_source)}<br>{self._static_info}</div>")


def _set_log_value(slider: widgets.FloatLogSlider, value: float) -> None:
    e = float(np.log(value) / np.log(slider.base))
    slider.min, slider.max = min(slider.min, np.floor(e)), max(slider.max, np.ceil(e))
    slider.value = value


def _all_reduce_fits(profile) -> dict:
    """form -> (alpha s, beta s/B) for all_reduce: the profile's own fit, plus a fit of the other form from
    the profile's samples when they allow one. Fits with alpha or beta <= 0 are left out (a log slider cannot
    show them, and they are not physical)."""
    from .fit import fit_alpha_beta  # scipy import deferred: explorer() without a profile does not need it

    fits = {}
    own = profile.fits.get("all_reduce")
    if own is not None:
        fits[own.form] = own
    for form in ("ring", "textbook"):
        if form not in fits and own is not None and len(profile.samples):
            try:
                fits[form] = fit_alpha_beta(profile.samples, "all_reduce", form, min_bytes=own.min_bytes,
                                            max_bytes=own.max_bytes, confidence=own.confidence)
            except ValueError:
                pass
    return {f: (x.alpha, x.beta) for f, x in fits.items() if x.alpha > 0 and x.beta > 0}


def _sync(widget: go.FigureWidget, fig: go.Figure) -> None:
    """Copy `fig`'s traces and layout into `widget` in one batch (one message to the browser).

    Traces are updated in place when the trace structure matches (the normal case); otherwise replaced.
    """
    layout = fig.layout.to_plotly_json()
    layout.pop("template", None)  # the same template every time; copying it is the slowest part
    with widget.batch_update():
        if len(widget.data) == len(fig.data) and all(a.type == b.type for a, b in zip(widget.data, fig.data)):
            for w, n in zip(widget.data, fig.data):
                d = n.to_plotly_json()
                d.pop("type", None)
                w.update(d, overwrite=True)
        else:
            widget.data = []
            widget.add_traces(list(fig.data))
        widget.layout.update(layout, overwrite=True)


def explorer(profile=None, compute=None, measured=None, param_nbytes=None) -> Explorer:
    """Build the interactive DDP step explorer (display it as the last expression of a cell).

    profile: a :class:`dtlab.fit.Profile`; alpha/beta start from its all_reduce fit (and its form), else
    from DEFAULT_ALPHA_S / DEFAULT_BANDWIDTH_GBS, labelled "default, not calibrated". Switching the form
    loads that form's fit from the profile's samples when possible. The GPU count starts at the largest
    p in the profile's samples (8 without a profile).
    compute: dict with t_fwd, t_bwd_comp, t_opt in seconds per rank (e.g.
    :func:`dtlab.model_figures.compute_from_run`), optional 'source' text; default: a labelled DistilBERT
    placeholder (DEFAULT_COMPUTE), not a measurement.
    measured: DataFrame with nproc, bucket_mb (MiB), t_step and optionally t_comm, t_comp (seconds), one
    row per measured run; drawn where p (or the bucket size, within 2 %) matches the bars.
    param_nbytes: gradient bytes in ready order (reverse registration order for DDP); default
    DistilBERT-base from :func:`dtlab.model_figures.distilbert_param_nbytes`.

    Controls: GPU count, bucket size (MiB), alpha (µs), bandwidth 1/beta (GB/s), ring/textbook, and whether
    the bars run across GPU counts or bucket sizes. A change only re-evaluates the model (nothing is run)
    and the redraw time is shown under the controls. Returns an :class:`Explorer` (an ipywidgets.VBox) with
    ``.sliders``, ``.figures``, ``.result``, ``.sweep`` and ``.last_redraw_s``.
    """
    return Explorer(profile=profile, compute=compute, measured=measured, param_nbytes=param_nbytes)
