"""The interactive explorer: sliders over the alpha-beta DDP step model, two live figures.

Widgets and wiring only. The model and the figures are the pure functions of :mod:`dtlab.viz.model_plots`;
a slider move re-evaluates that model (it never launches a run) and copies the new figures into the
existing `plotly.graph_objects.FigureWidget`s inside ``batch_update()``, so the browser receives one
update per figure.

    from dtlab.viz.dashboard import explorer
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

from dtlab.viz import model_plots as mf
from dtlab.viz.model_plots import fmt_bytes as fmt_size

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
#: the all-reduce forms as the label writes them
FORMULAS = {"ring": "2(p−1)α + 2(p−1)/p·nβ", "textbook": "α(p−1) + nβ/p"}


def _anchored_min(e: float, lo_exp: float, step: float) -> float:
    """The slider minimum at or below `lo_exp` that puts exponent `e` exactly on the slider's step grid.

    The browser's slider (noUiSlider) snaps its value to min + k * step and sends the snapped value back to
    the kernel as soon as it renders: a value off the grid would come back changed (25 MiB as 25.1 MiB, a
    fitted alpha as a slightly different one)."""
    return e - np.ceil((e - lo_exp) / step - 1e-9) * step


def _log_slider(value, lo_exp, hi_exp, base, step, description, fmt) -> widgets.FloatLogSlider:
    """A FloatLogSlider whose range contains `value` and whose step grid passes through it."""
    e = float(np.log(value) / np.log(base))
    lo_exp, hi_exp = _anchored_min(e, min(lo_exp, np.floor(e)), step), max(hi_exp, np.ceil(e))
    return widgets.FloatLogSlider(value=value, base=base, min=lo_exp, max=hi_exp, step=step,
                                  description=description, readout_format=fmt, continuous_update=True,
                                  style={"description_width": "150px"}, layout=widgets.Layout(width="480px"))


def _on_grid_of(slider: widgets.FloatLogSlider, value: float) -> bool:
    """True when the slider shows `value`: within half a step of it (the browser's snapping included)."""
    d = abs(np.log(float(slider.value)) - np.log(float(value))) / np.log(slider.base)
    return bool(d <= slider.step / 2 + 1e-9)


class Explorer(widgets.VBox):
    """The explorer widget returned by :func:`explorer`.

    Attributes for notebooks and tests:
      sliders        dict of the controls: nproc, bucket_mb, alpha_us, bandwidth_gbs, form, sweep
      figures        dict of FigureWidgets: breakdown, timeline
      result         the latest :func:`dtlab.viz.model_plots.whatif` dict (current setting)
      sweep          the latest :func:`dtlab.viz.model_plots.whatif_sweep` DataFrame (breakdown figure)
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
            alpha, beta, how = self._fits[form0]
        else:
            alpha, beta = DEFAULT_ALPHA_S, 1.0 / (DEFAULT_BANDWIDTH_GBS * 1e9)
            how = ("default, not calibrated: an assumed value (no profile given)" if profile is None else
                   "default, not calibrated: an assumed value (the profile has no usable all_reduce fit)")
            if profile is not None:
                notes.append("the profile has no usable all_reduce fit (missing, or alpha/beta not positive): "
                             "using defaults")
        #: where alpha and beta come from: the values the sliders started at (or were last loaded with)
        #: and how they were obtained. A slider showing a different value has been moved by the user.
        self._ref = {"alpha": alpha, "beta": beta, "how": how}
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
                                          style={"description_width": "150px", "button_width": "110px"}),
            "sweep": widgets.ToggleButtons(options=[("GPU count", "nproc"), ("bucket size", "bucket_mb")],
                                           value="nproc", description="bars across",
                                           style={"description_width": "150px", "button_width": "110px"}),
        }
        self._source_label = widgets.HTML()
        self._source_label.add_class("dtlab-sources")
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
            self.sliders[name].observe(self._on_ab_change, names="value")

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
        """The current setting in model units: nproc, bucket_mb (MiB), alpha (s), beta (s/byte), form.

        A slider that still shows the fitted (or default) value gives that exact value, not the slider's
        rounded copy of it: the explorer then predicts what the profile predicts."""
        s = self.sliders
        alpha = self._ref["alpha"] if not self.moved("alpha") else float(s["alpha_us"].value) * 1e-6
        beta = self._ref["beta"] if not self.moved("beta") else 1.0 / (float(s["bandwidth_gbs"].value) * 1e9)
        return {"nproc": int(s["nproc"].value), "bucket_mb": float(s["bucket_mb"].value),
                "alpha": alpha, "beta": beta, "form": s["form"].value}

    def moved(self, which: str) -> bool:
        """True when the user moved the 'alpha' or 'beta' (bandwidth) slider away from where the explorer put
        it (the profile's fit or the default). Judged by value, so the browser's echo of a value it snapped
        to the slider's grid is not a move."""
        if which == "alpha":
            return not _on_grid_of(self.sliders["alpha_us"], self._ref["alpha"] * 1e6)
        if which == "beta":
            return not _on_grid_of(self.sliders["bandwidth_gbs"], 1.0 / self._ref["beta"] / 1e9)
        raise ValueError(f"which must be 'alpha' or 'beta', got {which!r}")

    def sources(self) -> dict:
        """'alpha' and 'beta' -> one line saying which value the model uses and where it comes from."""
        p = self.params()
        out = {}
        for which, value, ref, unit, sym in (("alpha", p["alpha"] * 1e6, self._ref["alpha"] * 1e6, "µs", "α"),
                                             ("beta", 1 / p["beta"] / 1e9, 1 / self._ref["beta"] / 1e9, "GB/s",
                                              "1/β")):
            if self.moved(which):
                out[which] = (f"{sym} = {value:.3g} {unit}: moved by you, the model uses this value "
                              f"(from {ref:.3g} {unit}, {self._ref['how']})")
            else:
                out[which] = f"{sym} = {value:.3g} {unit}: {self._ref['how']}"
        return out

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
        title = (f"Predicted step across {across}<br>{p['form']} form, α = {p['alpha'] * 1e6:.3g} µs, "
                 f"1/β = {1 / p['beta'] / 1e9:.3g} GB/s; outlined bar: current setting")
        return mf.predicted_breakdown_figure(self.sweep, self._measured_overlay(p),
                                             highlight=mf.config_label(p["nproc"], p["bucket_mb"]), title=title)

    def _timeline_height(self) -> int:
        # follows the bucket count: a height fixed for the most buckets possible drew one bucket as a bar
        # hundreds of pixels thick. The timeline is the explorer's last child, so the sliders above it do
        # not move when it grows or shrinks.
        # at least tall enough for the legend's seven entries (a shorter plot gets a scrolling legend)
        return int(min(760, max(340, 250 + 18 * (self.result["n_buckets"] + 1))))

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

    def _on_ab_change(self, change) -> None:
        if not self._hold:
            self._update_source_label()

    def _on_form(self, change) -> None:
        """Switching the form loads that form's profile fit (when there is one) before redrawing: alpha and
        beta fitted under one form do not carry over to the other. Values the user moved stay as they are."""
        form, old = change["new"], change["old"]
        moved = {w: self.moved(w) for w in ("alpha", "beta")}
        if form in self._fits:
            alpha, beta, how = self._fits[form]
        else:  # nothing fitted under this form: the previous reference, labelled as the estimate it is
            alpha, beta = self._ref["alpha"], self._ref["beta"]
            how = (f"{self._ref['how']}; obtained under the {old} form and reused under {form} without refitting: "
                   "an estimate" if "fitted" in self._ref["how"] else self._ref["how"])
        self._ref = {"alpha": alpha, "beta": beta, "how": how}
        self._hold = True
        try:
            if not moved["alpha"]:
                _set_log_value(self.sliders["alpha_us"], alpha * 1e6)
            if not moved["beta"]:
                _set_log_value(self.sliders["bandwidth_gbs"], 1.0 / beta / 1e9)
        finally:
            self._hold = False
        self._update_source_label()
        self.redraw()

    def _update_source_label(self) -> None:
        parts = [line.partition(": ")[::2] for line in self.sources().values()]
        if parts[0][1] == parts[1][1]:  # same origin: one line
            parts = [(f"{parts[0][0]}, {parts[1][0]}", parts[0][1])]
        lines = [f"<b>{html.escape(head)}</b>: {html.escape(tail)}" for head, tail in parts]
        self._source_label.value = (f"<div style='font-size:90%;line-height:1.35'>{'<br>'.join(lines)}"
                                    f"<br>{self._static_info}</div>")


def _set_log_value(slider: widgets.FloatLogSlider, value: float) -> None:
    """Put `value` on the slider, widening the range and moving the step grid so that it lies on it; one
    message to the browser, so the view never sees the new range with the old value."""
    e = float(np.log(value) / np.log(slider.base))
    with slider.hold_sync():
        slider.min = _anchored_min(e, min(slider.min, np.floor(e)), slider.step)
        slider.max = max(slider.max, np.ceil(e))
        slider.value = value


def _all_reduce_fits(profile) -> dict:
    """form -> (alpha s, beta s/B, how) for all_reduce: the profile's own fit, plus a fit of the other form
    from the profile's samples when they allow one; `how` says which, for the label. Fits with alpha or
    beta <= 0 are left out (a log slider cannot show them, and they are not physical)."""
    from dtlab.model.fit import fit_alpha_beta  # scipy import deferred: explorer() without a profile does not need it

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
    out = {}
    for f, x in fits.items():
        if not (x.alpha > 0 and x.beta > 0):
            continue
        what = (f"fitted from the profile: all_reduce, {f} form {FORMULAS.get(f, '')}, "
                f"{fmt_size(x.min_bytes)} to {fmt_size(x.max_bytes)}")
        if f != own.form:
            what += f" (refitted from the profile's samples; the profile's own fit is {own.form})"
        out[f] = (x.alpha, x.beta, what)
    return out


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

    profile: a :class:`dtlab.model.fit.Profile`; alpha/beta start from its all_reduce fit (and its form), else
    from DEFAULT_ALPHA_S / DEFAULT_BANDWIDTH_GBS, labelled "default, not calibrated". Switching the form
    loads that form's fit from the profile's samples when possible. The label above the sliders says, for
    alpha and for 1/beta separately, which value the model uses and where it comes from: fitted from the
    profile (with the form and size range), a default, an estimate reused under another form, or "moved by
    you" once the slider shows another value (judged by value, so the browser snapping a value to the
    slider's grid is not a move). The GPU count starts at the largest p in the profile's samples (8
    without a profile).
    compute: dict with t_fwd, t_bwd_comp, t_opt in seconds per rank (e.g.
    :func:`dtlab.viz.model_plots.compute_from_run`), optional 'source' text; default: a labelled DistilBERT
    placeholder (DEFAULT_COMPUTE), not a measurement.
    measured: DataFrame with nproc, bucket_mb (MiB), t_step and optionally t_comm, t_comp (seconds), one
    row per measured run; drawn where p (or the bucket size, within 2 %) matches the bars.
    param_nbytes: gradient bytes in ready order (reverse registration order for DDP); default
    DistilBERT-base from :func:`dtlab.viz.model_plots.distilbert_param_nbytes`.

    Controls: GPU count, bucket size (MiB), alpha (µs), bandwidth 1/beta (GB/s), ring/textbook, and whether
    the bars run across GPU counts or bucket sizes. A change only re-evaluates the model (nothing is run)
    and the redraw time is shown under the controls. Returns an :class:`Explorer` (an ipywidgets.VBox) with
    ``.sliders``, ``.figures``, ``.result``, ``.sweep`` and ``.last_redraw_s``.
    """
    return Explorer(profile=profile, compute=compute, measured=measured, param_nbytes=param_nbytes)
