"""The explorer's state without widgets: where alpha and beta come from ("fitted from the profile", "default,
not calibrated", "moved by you"), what the controls mean for the model, which configurations the breakdown
figure shows, and the what-if model evaluated for them.

Pure: numpy, pandas and :mod:`dtlab.model.whatif`, no ipywidgets and no plotly, so it is testable without a
kernel. :mod:`dtlab.viz.dashboard` wires it to sliders and figures. Methods that depend on the controls
take `values`: control name -> the value the widget shows (nproc, bucket_mb in MiB, alpha_us in µs,
bandwidth_gbs in GB/s, form, sweep).
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from dtlab.model import buckets as bk
from dtlab.model import sharing
from dtlab.model import whatif as wi
from dtlab.model.compression import compression_from_run
from dtlab.model.link import Link
from dtlab.model.sharing import contention_from_profile
from dtlab.units import fmt_bytes
from dtlab.viz.controls import (
    R_STEP,
    all_reduce_fits,
    bucket_count,
    bucket_slider_range,
    clip_to_range,
    compression_setting,
)
from dtlab.viz.explorer_run import RunInputs
from dtlab.viz.loggrid import on_log_grid

#: Defaults when no profile is given: plausible for one NVLink/InfiniBand-class ring, *not calibrated*.
DEFAULT_ALPHA_S = 20e-6
DEFAULT_BANDWIDTH_GBS = 10.0
#: Placeholder DistilBERT compute per rank (seconds) when no `compute` is given: a rough guess for batch
#: 32 x 128 tokens on one data-center GPU, *not measured*. Pass `compute=compute_from_run(run)` instead.
DEFAULT_COMPUTE = {"t_fwd": 0.010, "t_bwd_comp": 0.020, "t_opt": 0.003}
DEFAULT_COMPUTE_SOURCE = (
    "placeholder, not measured: a rough guess for DistilBERT, batch 32 x 128 tokens per rank on one data-center GPU"
)
DEFAULT_BUCKET_MB = 25.0
#: The contention control: loaded / idle all-reduce time, from 1 (none) up to this, in these steps.
CONTENTION_MAX = 10.0
CONTENTION_STEP = 0.05
#: What the TP-degree control's all-reduces carry when no `tp_shape` is given: DistilBERT's blocks at the
#: placeholder compute's batch, *assumed*.
DEFAULT_TP_SHAPE = {
    "n_layers": 6,
    "hidden": 768,
    "n_heads": 12,
    "tokens": 32 * 128,
    "source": "assumed: DistilBERT's 6 blocks of hidden 768 at 32 x 128 tokens per rank",
}
#: x values of the breakdown figure (the current slider value is always added).
SWEEP_NPROC = (1, 2, 4, 8, 16, 32, 64)
SWEEP_BUCKET_MB = (0.25, 1.0, 5.0, 25.0, 100.0, 400.0, 1024.0)
#: a measured row matches the slider's bucket size within this relative tolerance (log sliders snap)
BUCKET_MATCH_RTOL = 0.02
MEASURED_COLUMNS = ("nproc", "bucket_mb", "t_step")
#: The log sliders: (lowest exponent, highest exponent, base, step in exponent units, description). The
#: range is widened to contain the start value.
LOG_SLIDERS = {
    "bucket_mb": (-7, 10, 2, 0.05, "bucket size (MiB)"),
    "alpha_us": (-1, 4, 10, 0.02, "α latency (µs)"),
    "bandwidth_gbs": (-2, 3, 10, 0.02, "1/β bandwidth (GB/s)"),
    "ratio": (-3, 0, 10, R_STEP, "compression r"),
}


# ------------------------------------------------------------ the explorer's inputs, checked


def _checked_tp_shape(tp_shape) -> dict:
    shape = dict(tp_shape) if tp_shape is not None else dict(DEFAULT_TP_SHAPE)
    for k in ("n_layers", "hidden", "n_heads", "tokens"):
        if not isinstance(shape.get(k), (int, np.integer)) or shape[k] < 1:
            raise ValueError(f"tp_shape must give {k} as an integer >= 1, got {shape.get(k)!r}")
    return shape


def _checked_compression(compression) -> dict:
    comp = (
        dict(compression)
        if compression is not None
        else {"ratio": 1.0, "encode_s_per_byte": 0.0, "source": "no compression (r = 1)"}
    )
    if not 0 < comp["ratio"] <= 1 or not comp.get("encode_s_per_byte", 0.0) >= 0:
        raise ValueError(f"compression needs ratio in (0, 1] and encode_s_per_byte >= 0 (s/B), got {compression}")
    return comp


def _reference(profile, fits: dict, form: str) -> tuple[dict, list[str]]:
    """(where alpha and beta start: alpha, beta and how they were obtained; notes for the label)."""
    notes = []
    if form in fits:
        alpha, beta, how = fits[form]
    else:
        alpha, beta = DEFAULT_ALPHA_S, 1.0 / (DEFAULT_BANDWIDTH_GBS * 1e9)
        how = (
            "default, not calibrated: an assumed value (no profile given)"
            if profile is None
            else "default, not calibrated: an assumed value (the profile has no usable all_reduce fit)"
        )
        if profile is not None:
            notes.append(
                "the profile has no usable all_reduce fit (missing, or alpha/beta not positive): using defaults"
            )
    if profile is not None and profile.caveats:
        notes += [f"profile caveat: {c}" for c in profile.caveats]
    return {"alpha": alpha, "beta": beta, "how": how}, notes


def _checked_compute(compute) -> dict:
    compute = dict(compute) if compute is not None else dict(DEFAULT_COMPUTE, source=DEFAULT_COMPUTE_SOURCE)
    for k in ("t_fwd", "t_bwd_comp", "t_opt"):
        if k not in compute or not np.isfinite(compute[k]) or compute[k] < 0:
            raise ValueError(f"compute must give {k} in seconds (finite, >= 0); got {compute.get(k)!r}")
    return compute


def _gradient_sizes(param_nbytes) -> tuple[list[int], str]:
    """(gradient bytes in ready order, where they come from)."""
    if param_nbytes is None:
        sizes = wi.distilbert_param_nbytes()[::-1]
        return sizes, "DistilBERT-base (66,955,010 fp32 parameters), reverse registration order"
    sizes = [int(x) for x in param_nbytes]
    if not sizes or sum(sizes) <= 0:
        raise ValueError("param_nbytes must list gradient sizes in bytes (ready order) with a positive total")
    return sizes, f"{len(sizes)} tensors given by the caller ({fmt_bytes(sum(sizes))})"


def _measured_rows(measured) -> pd.DataFrame | None:
    if measured is None:
        return None
    missing = [c for c in MEASURED_COLUMNS if c not in measured.columns]
    if missing:
        raise ValueError(
            f"measured is missing columns {missing}; needs nproc, bucket_mb, t_step (seconds), "
            "optionally t_comm, t_comp"
        )
    # a sweep's skipped or failed rows have no times: nothing to draw
    return measured[measured["t_step"].notna()].reset_index(drop=True)


def _static_info(compute: dict, sizes_source: str, measured, notes: list[str]) -> str:
    """The label's HTML that no control changes: compute, gradients, measured rows, warnings."""
    c_ms = {k: compute[k] * 1e3 for k in ("t_fwd", "t_bwd_comp", "t_opt")}
    info = [
        f"<b>compute per rank</b>: fwd {c_ms['t_fwd']:.3g} ms, bwd {c_ms['t_bwd_comp']:.3g} ms, "
        f"opt {c_ms['t_opt']:.3g} ms ({html.escape(compute.get('source', 'given by the caller'))}); assumed "
        "independent of p (fixed per-rank batch)",
        f"<b>gradients</b>: {html.escape(sizes_source)}; backward assumed spread over buckets by bytes",
        "<b>measured</b>: "
        + ("none" if measured is None else f"{len(measured)} rows, shown where p and bucket size match"),
    ]
    return "<br>".join(info + [f"<span style='color:#8a4b00'>⚠ {html.escape(n)}</span>" for n in notes])


class ExplorerState:
    """The inputs of the explorer, checked, and the logic between its controls and the model.

    Attributes: fits (form -> (alpha, beta, how), :func:`all_reduce_fits`), form0 and nproc0 (where the
    controls start), ref (where alpha and beta come from: the values the sliders started at, or were last
    loaded with, and how they were obtained; a slider showing another value was moved by the user),
    compute (per-rank seconds), sizes (gradient bytes in ready order), bucket_range ((lo, hi) exponents, base
    2, of the bucket sizes where the bucket count changes, or None: then no bucket control can change anything,
    :func:`dtlab.viz.controls.bucket_slider_range`), bucket0 (where the bucket control starts, MiB), measured
    (rows with times, or None), notes (warnings for the label) and static_info (the label's HTML that no
    control changes).
    """

    def __init__(
        self, profile=None, compute=None, measured=None, param_nbytes=None, compression=None, tp_shape=None, run=None
    ):
        # ---- a run: its compute, gradient sizes and compression, and every prediction its own what-if
        self.run = None if run is None else RunInputs(run, profile)
        if self.run is not None:
            given = [k for k, v in (("compute", compute), ("param_nbytes", param_nbytes)) if v is not None]
            if given:
                raise ValueError(f"{' and '.join(given)}: come from the run when run= is given; pass one or the other")
            compute, param_nbytes = self.run.compute, self.run.sizes
            if compression is None and self.run.run.config.compression.hook not in (None, "none"):
                compression = compression_from_run(self.run.run)
        # ---- tensor parallelism: the blocks and activations its all-reduces carry (the TP-degree control)
        self.tp_shape = _checked_tp_shape(tp_shape)
        self.tp_options = [t for t in range(1, 65) if self.tp_shape["n_heads"] % t == 0]
        # ---- compression r (bytes on the wire / gradient bytes) and encode cost: a measured hook, else none
        self.comp = _checked_compression(compression)
        # ---- alpha, beta: the profile's all_reduce fit, else labelled defaults
        self.fits = all_reduce_fits(profile) if profile is not None else {}
        self.form0 = profile.fits["all_reduce"].form if profile is not None and "all_reduce" in profile.fits else "ring"
        self.ref, notes = _reference(profile, self.fits, self.form0)
        # ---- compute per rank, gradient sizes in ready order, the measured sweep to overlay
        self.compute = _checked_compute(compute)
        self.sizes, sizes_source = _gradient_sizes(param_nbytes)
        sizes_source = self.run.sizes_source if self.run is not None else sizes_source
        self.measured = _measured_rows(measured)

        # ---- the GPU count starts at the largest p the profile measured (where it is calibrated)
        self.nproc0 = 8
        if profile is not None and len(profile.samples):
            self.nproc0 = int(np.clip(profile.samples["nproc"].max(), 1, 64))

        lo, hi, _, step, _ = LOG_SLIDERS["bucket_mb"]
        self.bucket_range = bucket_slider_range(self.sizes, lo, hi, step)
        self.bucket0 = clip_to_range(DEFAULT_BUCKET_MB, self.bucket_range)
        # ---- contention: loaded / idle all-reduce time at the starting bucket size, from a loaded calibration
        cap = bk.mb_to_bytes(self.bucket0)
        start_bytes = float(np.median(bk.bucket_sizes(self.sizes, bk.bucket_layout(self.sizes, cap, cap))))
        factor, how = contention_from_profile(profile, start_bytes)
        self.contention0 = float(np.clip(round(factor / CONTENTION_STEP) * CONTENTION_STEP, 1.0, CONTENTION_MAX))
        self.contention_how = how
        # ---- backward seconds lost per second of communication in flight, from a loaded calibration (0: none)
        self.stretch, self.stretch_how = sharing.stretch_from_profile(profile)
        self.notes = notes
        self.static_info = _static_info(self.compute, sizes_source, self.measured, notes)

    # ------------------------------------------------------------ alpha and beta
    def moved(self, which: str, values: dict) -> bool:
        """True when the user moved the 'alpha' or 'beta' (bandwidth) slider away from where the explorer put
        it (the profile's fit or the default). Judged by value, so the browser's echo of a value it snapped
        to the slider's grid is not a move."""
        if which == "alpha":
            name, ref = "alpha_us", self.ref["alpha"] * 1e6
        elif which == "beta":
            name, ref = "bandwidth_gbs", 1.0 / self.ref["beta"] / 1e9
        else:
            raise ValueError(f"which must be 'alpha' or 'beta', got {which!r}")
        _, _, base, step, _ = LOG_SLIDERS[name]
        return not on_log_grid(values[name], ref, base, step)

    def params(self, values: dict) -> dict:
        """The setting in model units: nproc, bucket_mb (MiB), alpha (s), beta (s/byte), form.

        A slider that still shows the fitted (or default) value gives that exact value, not the slider's
        rounded copy of it: the explorer then predicts what the profile predicts."""
        alpha = self.ref["alpha"] if not self.moved("alpha", values) else float(values["alpha_us"]) * 1e-6
        beta = self.ref["beta"] if not self.moved("beta", values) else 1.0 / (float(values["bandwidth_gbs"]) * 1e9)
        r, encode, _ = compression_setting(self.comp, values.get("ratio", self.comp["ratio"]))
        return {
            "nproc": int(values["nproc"]),
            "bucket_mb": float(values["bucket_mb"]),
            "alpha": alpha,
            "beta": beta,
            "form": values["form"],
            "ratio": r,
            "encode_s_per_byte": encode,
            "contention": float(values.get("contention", self.contention0)),
            "tp": int(values.get("tp", 1)),
        }

    def contention_line(self, values: dict) -> str:
        """What the contention control means now and where its value comes from."""
        c = float(values.get("contention", self.contention0))
        what = (
            "none: every all-reduce at its idle price"
            if c == 1
            else f"an all-reduce in flight while backward runs takes ×{c:.3g} its idle time, the idle time after"
        )
        origin = (
            self.contention_how
            if abs(c - self.contention0) < CONTENTION_STEP / 2
            else f"moved by you (from ×{self.contention0:.3g}: {self.contention_how})"
        )
        return f"{what} ({origin})"

    def link(self, p: dict) -> Link:
        """The setting's link: alpha, beta and form from the controls, contention from its control, the profile's
        stretch."""
        return Link(alpha=p["alpha"], beta=p["beta"], form=p["form"], contention=p["contention"], stretch=self.stretch)

    def tp(self, p: dict) -> dict | None:
        """:func:`dtlab.model.whatif.tp_setting` for the setting's TP degree (None at t = 1)."""
        if p["tp"] <= 1:
            return None
        s = self.tp_shape
        return wi.tp_setting(p["tp"], s["n_layers"], s["tokens"], s["hidden"])

    def tp_line(self, values: dict) -> str:
        """The label's line on tensor parallelism: what t does to the model, where its sizes come from."""
        p = self.params(values)
        s = self.tp_shape
        src = html.escape(s.get("source", "given by the caller"))
        if p["tp"] <= 1:
            return f"t = 1: no tensor parallelism (the control splits each block over t GPUs; sizes {src})"
        tp = self.tp(p)
        each = float(self.link(p).time("all_reduce", tp["allreduce_bytes"], p["tp"]))
        dp = max(1, p["nproc"] // p["tp"])
        warn = (
            ""
            if p["nproc"] % p["tp"] == 0 and p["nproc"] >= p["tp"]
            else f" (p = {p['nproc']} is not a multiple of t: {dp} replica(s) of t)"
        )
        return (
            f"t = {p['tp']}: {dp} replica(s) of {p['tp']} GPUs{warn}; per step {tp['allreduces']} all-reduces of "
            f"{fmt_bytes(tp['allreduce_bytes'])} over t ranks on the compute path "
            f"({each * tp['allreduces'] * 1e3:.3g} ms); compute, optimizer and gradients per GPU / t (an estimate); "
            f"sizes {src}"
        )

    def sources(self, values: dict) -> dict:
        """'alpha' and 'beta' -> one line saying which value the model uses and where it comes from."""
        p = self.params(values)
        out = {}
        for which, value, ref, unit, sym in (
            ("alpha", p["alpha"] * 1e6, self.ref["alpha"] * 1e6, "µs", "α"),
            ("beta", 1 / p["beta"] / 1e9, 1 / self.ref["beta"] / 1e9, "GB/s", "1/β"),
        ):
            if self.moved(which, values):
                out[which] = (
                    f"{sym} = {value:.3g} {unit}: moved by you, the model uses this value "
                    f"(from {ref:.3g} {unit}, {self.ref['how']})"
                )
            else:
                out[which] = f"{sym} = {value:.3g} {unit}: {self.ref['how']}"
        return out

    def source_html(self, values: dict) -> str:
        """The label above the sliders: where alpha and beta come from (one line when both share an origin),
        then :attr:`static_info`."""
        parts = [line.partition(": ")[::2] for line in self.sources(values).values()]
        if parts[0][1] == parts[1][1]:  # same origin: one line
            parts = [(f"{parts[0][0]}, {parts[1][0]}", parts[0][1])]
        lines = [f"<b>{html.escape(head)}</b>: {html.escape(tail)}" for head, tail in parts]
        lines.append(
            f"<b>compression</b>: "
            f"{html.escape(compression_setting(self.comp, values.get('ratio', self.comp['ratio']))[2])} "
            "(r = bytes on the wire / gradient bytes)"
        )
        lines.append(f"<b>buckets</b>: {self.bucket_line(values['bucket_mb'])}")
        lines.append(f"<b>compute contention</b>: {html.escape(self.contention_line(values))}")
        lines.append(f"<b>compute lost to communication in flight</b>: {html.escape(self.stretch_how)}")
        lines.append(f"<b>tensor parallelism</b>: {self.tp_line(values)}")
        return f"<div style='font-size:90%;line-height:1.35'>{'<br>'.join(lines)}<br>{self.static_info}</div>"

    def bucket_line(self, bucket_mb: float) -> str:
        """How many buckets the current cap makes, and over which caps the count changes at all."""
        n = bucket_count(self.sizes, bucket_mb)
        if self.bucket_range is None:
            return f"{n} at every bucket size (these gradients cannot be split further): no bucket control"
        lo, hi = (2.0**e for e in self.bucket_range)
        return (
            f"{n} at {bucket_mb:.3g} MiB; the count changes between {lo:.3g} and {hi:.3g} MiB (one bucket from "
            f"{hi:.3g} MiB up), the slider's range"
        )

    def switch_form(self, form: str, old: str, values: dict) -> dict:
        """Switch the reference to `form` (values: the controls before the switch); returns slider name ->
        value for the sliders to move (those the user has not moved).

        Switching the form loads that form's profile fit (when there is one): alpha and beta fitted under one
        form do not carry over to the other. Values the user moved stay as they are."""
        moved = {w: self.moved(w, values) for w in ("alpha", "beta")}
        if form in self.fits:
            alpha, beta, how = self.fits[form]
        else:  # nothing fitted under this form: the previous reference, labelled as the estimate it is
            alpha, beta = self.ref["alpha"], self.ref["beta"]
            how = (
                f"{self.ref['how']}; obtained under the {old} form and reused under {form} without refitting: "
                "an estimate"
                if "fitted" in self.ref["how"]
                else self.ref["how"]
            )
        self.ref = {"alpha": alpha, "beta": beta, "how": how}
        out = {}
        if not moved["alpha"]:
            out["alpha_us"] = alpha * 1e6
        if not moved["beta"]:
            out["bandwidth_gbs"] = 1.0 / beta / 1e9
        return out

    # ------------------------------------------------------------ the breakdown's configurations
    def configs(self, p: dict, sweep: str) -> list[tuple[int, float]]:
        """(nproc, bucket_mb) pairs of the breakdown figure at setting `p` (:meth:`params`), bars across
        `sweep` ('nproc' or 'bucket_mb'): the sweep grid, the current setting and any matching measured
        configuration; one per label, the current setting winning a label clash."""
        cur = (p["nproc"], p["bucket_mb"])
        if sweep == "nproc":
            values = set(SWEEP_NPROC) | {cur[0]} | set(self.matching_measured(p, sweep)["nproc"].astype(int))
            cands = [(n, cur[1]) for n in sorted(values)]
        else:
            values = set(self.sweep_buckets()) | set(self.matching_measured(p, sweep)["bucket_mb"].astype(float))
            cands = [(cur[0], b) for b in sorted(values)]
            cands = sorted(
                [c for c in cands if wi.config_label(*c) != wi.config_label(*cur)] + [cur], key=lambda c: c[1]
            )
        seen, out = set(), []
        for c in cands:
            lab = wi.config_label(*c)
            if lab not in seen:
                seen.add(lab)
                out.append(c)
        return out

    def sweep_buckets(self) -> list:
        """Bucket sizes (MiB) for bars across bucket size: :data:`SWEEP_BUCKET_MB` inside the range where the
        count changes, and the size that makes one bucket."""
        if self.bucket_range is None:
            return [self.bucket0]
        lo, hi = (2.0**e for e in self.bucket_range)
        return sorted({b for b in SWEEP_BUCKET_MB if lo <= b < hi} | {lo, hi})

    def matching_measured(self, p: dict, sweep: str) -> pd.DataFrame:
        """Measured rows comparable with the breakdown figure's x axis at setting `p`."""
        m = self.measured
        if m is None:
            return pd.DataFrame(columns=list(MEASURED_COLUMNS))
        if sweep == "nproc":
            return m[np.isclose(m["bucket_mb"].astype(float), p["bucket_mb"], rtol=BUCKET_MATCH_RTOL)]
        return m[m["nproc"].astype(int) == p["nproc"]]

    def measured_overlay(self, p: dict, sweep: str) -> pd.DataFrame | None:
        """The matching measured rows relabelled to the figure's x labels (None without measurements)."""
        if self.measured is None:
            return None
        cols = ["label"] + [c for c in ("t_step", "t_comm", "t_comp") if c in self.measured.columns]
        m = self.matching_measured(p, sweep)
        if m.empty:
            return pd.DataFrame({c: pd.Series(dtype=object if c == "label" else float) for c in cols})
        if sweep == "nproc":  # snapped to the slider's bucket size (within tolerance)
            labels = [wi.config_label(n, p["bucket_mb"]) for n in m["nproc"]]
        else:
            labels = [wi.config_label(p["nproc"], b) for b in m["bucket_mb"]]
        out = m.assign(label=labels)
        return out[cols]

    # ------------------------------------------------------------ the model
    def model(self, values: dict) -> tuple[dict, pd.DataFrame]:
        """(:func:`dtlab.model.whatif.whatif` of the current setting, :func:`dtlab.model.whatif.whatif_sweep`
        over the breakdown's configurations); given a run, both are its own what-if (run.whatif, whatif_table:
        :mod:`dtlab.viz.explorer_run`) but at a TP degree above 1, which run.whatif does not model."""
        p = self.params(values)
        c = self.compute
        link = self.link(p)
        if self.run is not None and p["tp"] <= 1:  # the run's own what-if (run.whatif has no tensor parallelism)
            unmoved = not self.moved("alpha", values) and not self.moved("beta", values) and p["form"] == self.form0
            unmoved = unmoved and abs(p["contention"] - self.contention0) < CONTENTION_STEP / 2
            return self.run.model(self.run.link(p, unmoved), p, self.configs(p, values["sweep"]))
        # a run's readiness (compute_from_run's ready_curve) where the compute came from one: the run's what-if's
        kw = dict(encode_s_per_byte=p["encode_s_per_byte"], tp=self.tp(p), ready_curve=c.get("ready_curve"))
        args = (c["t_fwd"], c["t_bwd_comp"], c["t_opt"], self.sizes)
        result = wi.whatif(*args, p["bucket_mb"], p["nproc"], link, p["ratio"], **kw)
        sweep = wi.whatif_sweep(*args, self.configs(p, values["sweep"]), link, p["ratio"], **kw)
        return result, sweep
