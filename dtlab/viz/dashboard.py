"""The interactive explorer: sliders over the alpha-beta DDP step model, two live figures.

Widgets and wiring only. What the controls mean (where alpha and beta come from, "moved by you", which
configurations the bars show) is :class:`dtlab.viz.explorer_state.ExplorerState`, the model is
:mod:`dtlab.model.whatif` and the figures are :mod:`dtlab.viz.model_plots`, all pure. A slider move
re-evaluates that model (it never launches a run) and shows the new figures (:class:`LiveFigure`: an output
widget holding the figure, which the browser draws whole).

    from dtlab.viz.dashboard import explorer
    explorer()                                    # defaults: labelled, not calibrated
    explorer(profile=load_profile("profiles/x"), compute=compute_from_run(run), measured=sweep_df)
"""

from __future__ import annotations

import time

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go

from dtlab.model.whatif import config_label
from dtlab.viz.explorer_state import CONTENTION_MAX, CONTENTION_STEP, LOG_SLIDERS, ExplorerState
from dtlab.viz.livefigure import FigureBox, LiveFigure
from dtlab.viz.loggrid import anchored_min, log_range
from dtlab.viz.model_plots import predicted_breakdown_figure, whatif_timeline_figure

_STYLE = {"description_width": "150px"}


def _log_slider(name: str, value: float, exps=None) -> widgets.FloatLogSlider:
    """The log slider `name` of :data:`dtlab.viz.explorer_state.LOG_SLIDERS`, showing `value`: its range
    (`exps` = (lowest, highest) exponent instead of the table's, when given) contains `value` and its step
    grid passes through it."""
    lo_exp, hi_exp, base, step, description = LOG_SLIDERS[name]
    if exps is None:
        lo, hi = log_range(value, lo_exp, hi_exp, base, step)
    else:  # exactly the given range (where the control changes something), widened only to hold `value`
        e = float(np.log(value) / np.log(base))
        lo, hi = anchored_min(e, min(exps[0], e), step), max(exps[1], e)
    return widgets.FloatLogSlider(
        value=value,
        base=base,
        min=lo,
        max=hi,
        step=step,
        description=description,
        readout_format=".4g",
        continuous_update=True,
        style=_STYLE,
        layout=widgets.Layout(width="480px"),
    )


def _set_log_value(slider: widgets.FloatLogSlider, value: float) -> None:
    """Put `value` on the slider, widening the range and moving the step grid so that it lies on it; one
    message to the browser, so the view never sees the new range with the old value."""
    lo, hi = log_range(value, slider.min, slider.max, slider.base, slider.step)
    with slider.hold_sync():
        slider.min, slider.max = lo, hi
        slider.value = value


def _controls(st: ExplorerState) -> dict:
    """The explorer's controls, by name, where the state `st` starts them."""
    buttons = dict(_STYLE, button_width="110px")
    return {
        "nproc": widgets.IntSlider(
            value=st.nproc0,
            min=1,
            max=64,
            step=1,
            description="GPU count p",
            continuous_update=True,
            style=_STYLE,
            layout=widgets.Layout(width="480px"),
        ),
        "tp": widgets.SelectionSlider(
            options=st.tp_options,
            value=1,
            description="TP degree t",
            continuous_update=True,
            style=_STYLE,
            layout=widgets.Layout(width="480px"),
        ),
        "bucket_mb": _log_slider("bucket_mb", st.bucket0, st.bucket_range),
        "alpha_us": _log_slider("alpha_us", st.ref["alpha"] * 1e6),
        "bandwidth_gbs": _log_slider("bandwidth_gbs", 1.0 / st.ref["beta"] / 1e9),
        "ratio": _log_slider("ratio", st.comp["ratio"]),
        "contention": widgets.FloatSlider(
            value=st.contention0,
            min=1.0,
            max=CONTENTION_MAX,
            step=CONTENTION_STEP,
            description="contention ×",
            readout_format=".2f",
            continuous_update=True,
            style=_STYLE,
            layout=widgets.Layout(width="480px"),
        ),
        "form": widgets.ToggleButtons(
            options=["ring", "textbook"], value=st.form0, description="model form", style=buttons
        ),
        "sweep": widgets.ToggleButtons(
            options=[("GPU count", "nproc"), ("bucket size", "bucket_mb")],
            value="nproc",
            description="bars across",
            style=buttons,
        ),
    }


class Explorer(FigureBox):
    """The explorer widget returned by :func:`explorer`.

    Attributes for notebooks and tests:
      sliders        dict of the controls: nproc, tp, bucket_mb, alpha_us, bandwidth_gbs, ratio, contention, form,
                     sweep
      figures        dict of LiveFigures: breakdown, timeline
      state          the :class:`dtlab.viz.explorer_state.ExplorerState` (inputs, where alpha/beta come from)
      result         the latest :func:`dtlab.model.whatif.whatif` dict (current setting)
      sweep          the latest :func:`dtlab.model.whatif.whatif_sweep` DataFrame (breakdown figure)
      last_redraw_s  seconds the latest redraw took (model + figure update in this kernel; the browser's
                     own rendering comes on top and is not measured)
      redraw_times   every redraw's seconds, oldest first (the first is the warm-up redraw at build time)
    """

    def __init__(
        self, profile=None, compute=None, measured=None, param_nbytes=None, compression=None, tp_shape=None, run=None
    ):
        self.state = st = ExplorerState(
            profile=profile,
            compute=compute,
            measured=measured,
            param_nbytes=param_nbytes,
            compression=compression,
            tp_shape=tp_shape,
            run=run,
        )
        self.sliders = _controls(st)
        self._source_label = widgets.HTML()
        self._source_label.add_class("dtlab-sources")
        self.redraw_label = widgets.Label("redraw – ms")
        self.result = None
        self.sweep = None
        self.last_redraw_s = None
        self.redraw_times: list[float] = []
        self._hold = False

        # ---- figures: from the pure functions, shown again whole on every redraw (LiveFigure)
        self._compute_model()
        self.figures = {
            "breakdown": LiveFigure(self._breakdown_fig()),
            "timeline": LiveFigure(self._timeline_fig()),
        }
        for name in ("nproc", "tp", "bucket_mb", "alpha_us", "bandwidth_gbs", "ratio", "contention", "sweep"):
            self.sliders[name].observe(self._on_change, names="value")
        self.sliders["form"].observe(self._on_form, names="value")
        for name in ("alpha_us", "bandwidth_gbs", "contention"):  # their origin line in the label changes too
            self.sliders[name].observe(self._on_ab_change, names="value")

        if st.bucket_range is None:  # one bucket at every size: a slider here could change nothing
            self.sliders["bucket_mb"].layout.display = "none"
            self.sliders["sweep"].layout.display = "none"
        self._update_source_label()
        controls = widgets.VBox(
            [
                self.sliders[k]
                for k in (
                    "nproc",
                    "tp",
                    "bucket_mb",
                    "alpha_us",
                    "bandwidth_gbs",
                    "ratio",
                    "contention",
                    "form",
                    "sweep",
                )
            ]
            + [self.redraw_label]
        )
        super().__init__(children=[self._source_label, controls, self.figures["breakdown"], self.figures["timeline"]])
        self.redraw()  # warms the model and figure code, so the first slider move is as fast as the rest

    # ------------------------------------------------------------ state
    def values(self) -> dict:
        """Control name -> the value it shows."""
        return {name: w.value for name, w in self.sliders.items()}

    def params(self) -> dict:
        """The current setting in model units (:meth:`dtlab.viz.explorer_state.ExplorerState.params`)."""
        return self.state.params(self.values())

    def moved(self, which: str) -> bool:
        """True when the user moved the 'alpha' or 'beta' slider (:meth:`ExplorerState.moved`)."""
        return self.state.moved(which, self.values())

    def sources(self) -> dict:
        """'alpha' and 'beta' -> one line saying which value the model uses and where it comes from."""
        return self.state.sources(self.values())

    def _compute_model(self) -> None:
        self.result, self.sweep = self.state.model(self.values())

    def _breakdown_fig(self) -> go.Figure:
        p, sweep = self.params(), self.sliders["sweep"].value
        across = "GPU count" if sweep == "nproc" else "bucket size"
        tp = f", TP degree t = {p['tp']}" if p["tp"] > 1 else ""
        title = (
            f"Predicted step across {across}<br>{p['form']} form, α = {p['alpha'] * 1e6:.3g} µs, "
            f"1/β = {1 / p['beta'] / 1e9:.3g} GB/s, compression r = {p['ratio']:.3g}{tp}; outlined bar: current setting"
        )
        return predicted_breakdown_figure(
            self.sweep,
            self.state.measured_overlay(p, sweep),
            highlight=config_label(p["nproc"], p["bucket_mb"]),
            title=title,
        )

    def _timeline_fig(self) -> go.Figure:
        # the height follows the bucket count: a height fixed for the most buckets possible drew one bucket as
        # a bar hundreds of pixels thick. The timeline is the explorer's last child, so the sliders above it do
        # not move when it grows or shrinks. At least tall enough for the legend's seven entries (a shorter
        # plot gets a scrolling legend).
        height = int(min(760, max(340, 250 + 18 * (self.result["n_buckets"] + 1))))
        return whatif_timeline_figure(self.result, height=height)

    # ------------------------------------------------------------ callbacks
    def redraw(self, change=None) -> None:
        """Recompute the model for the current sliders and show both figures again (timed)."""
        t0 = time.perf_counter()
        self._compute_model()
        self.figures["breakdown"].show(self._breakdown_fig())
        self.figures["timeline"].show(self._timeline_fig())
        self._update_source_label()  # compression and bucket lines follow their sliders
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
        """Switching the form loads that form's profile fit (when there is one) before redrawing; values the
        user moved stay as they are (:meth:`dtlab.viz.explorer_state.ExplorerState.switch_form`)."""
        to_set = self.state.switch_form(change["new"], change["old"], self.values())
        self._hold = True
        try:
            for name, value in to_set.items():
                _set_log_value(self.sliders[name], value)
        finally:
            self._hold = False
        self._update_source_label()
        self.redraw()

    def _update_source_label(self) -> None:
        self._source_label.value = self.state.source_html(self.values())


def explorer(
    profile=None, compute=None, measured=None, param_nbytes=None, compression=None, tp_shape=None, run=None
) -> Explorer:
    """Build the interactive DDP step explorer (display it as the last expression of a cell).

    profile: a :class:`dtlab.model.profile.Profile`; alpha/beta start from its all_reduce fit (and its form),
    else from DEFAULT_ALPHA_S / DEFAULT_BANDWIDTH_GBS (:mod:`dtlab.viz.explorer_state`), labelled "default,
    not calibrated". Switching the form loads that form's fit from the profile's samples when possible. The
    label above the sliders says, for alpha and for 1/beta separately, which value the model uses and where
    it comes from: fitted from the profile (with the form and size range), a default, an estimate reused
    under another form, or "moved by you" once the slider shows another value (judged by value, so the
    browser snapping a value to the slider's grid is not a move). The GPU count starts at the largest p in
    the profile's samples (8 without a profile).
    compute: dict with t_fwd, t_bwd_comp, t_opt in seconds per rank (e.g.
    :func:`dtlab.model.whatif.compute_from_run`), optional 'source' text; default: a labelled DistilBERT
    placeholder (DEFAULT_COMPUTE), not a measurement.
    measured: DataFrame with nproc, bucket_mb (MiB), t_step and optionally t_comm, t_comp (seconds), one
    row per measured run; drawn where p (or the bucket size, within 2 %) matches the bars.
    param_nbytes: gradient bytes in ready order (reverse registration order for DDP); default
    DistilBERT-base from :func:`dtlab.model.whatif.distilbert_param_nbytes`.
    compression: dict with ratio (bytes on the wire / gradient bytes), encode_s_per_byte (s/B) and source,
    e.g. :func:`dtlab.model.compression.compression_from_run` of a run with a comm hook; default r = 1.

    tp_shape: what the TP-degree control's all-reduces carry: n_layers, hidden, n_heads, tokens (batch x sequence
    length per rank) and source; default DistilBERT at 32 x 128 tokens, labelled as assumed.
    run: a measured DDP run (instead of compute and param_nbytes): every prediction is then the run's own what-if
    (``run.whatif`` at the setting, :func:`dtlab.results.whatif.whatif_table` for the bars), with its compute,
    readiness, gradient sizes, compression and, where the profile was calibrated on its machine, cores, load and
    wait; the profile's own Link (its size regimes, contention and stretch) while alpha, beta, form and contention
    show what it fitted. At a TP degree above 1 the run's inputs go through the step model directly.

    Controls: GPU count, TP degree t (Megatron tensor parallelism inside each of p // t replicas:
    :func:`dtlab.model.whatif.whatif`'s `tp`), bucket size (MiB), alpha (µs), bandwidth 1/beta (GB/s), compression r
    (bytes on the wire / gradient bytes: it scales the bandwidth term), ring/textbook, and whether
    the bars run across GPU counts or bucket sizes. A change only re-evaluates the model (nothing is run)
    and the redraw time is shown under the controls. Returns an :class:`Explorer` (an ipywidgets.VBox) with
    ``.sliders``, ``.figures``, ``.state``, ``.result``, ``.sweep`` and ``.last_redraw_s``.
    """
    return Explorer(
        profile=profile,
        compute=compute,
        measured=measured,
        param_nbytes=param_nbytes,
        compression=compression,
        tp_shape=tp_shape,
        run=run,
    )
