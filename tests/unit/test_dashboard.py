"""The explorer's pure model (dtlab.model.whatif), its figures (dtlab.viz.model_plots, dtlab.viz.calibration),
its state (dtlab.viz.explorer_state) and its widget wiring (dtlab.viz.dashboard).

No torch, no runs: synthetic profiles and sweeps only. Redraw times are recorded, never asserted."""

import json
import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from dtlab.config.run import RunConfig
from dtlab.model import costmodel as cm
from dtlab.model import whatif as wi
from dtlab.model.link import Link
from dtlab.model.profile import Profile
from dtlab.viz import calibration as cp
from dtlab.viz import model_plots as mf

ALPHA, BETA = 2e-5, 1e-10  # s, s/B (10 GB/s)
LINK = Link(alpha=ALPHA, beta=BETA)


UNIT = re.compile(r"\((ms|µs|%|bytes|MiB|GB/s)[^)]*\)|\b(ms|bytes|MiB|GB/s|processes)\b")


COMPUTE = {"t_fwd": 0.010, "t_bwd_comp": 0.020, "t_opt": 0.003}


def synth_profile(caveats=None, nprocs=(1, 2, 4)) -> Profile:
    rng = np.random.default_rng(0)
    rows = []
    for op in ("all_reduce", "all_gather"):
        for p in nprocs:
            for n in [2**k for k in range(10, 27, 2)]:
                t = cm.collective_time(op, "ring", ALPHA, BETA, n, p) if p > 1 else 5e-6
                rows += [
                    {"op": op, "nbytes": n, "nproc": p, "seconds": t * (1 + 0.03 * abs(rng.standard_normal()))}
                    for _ in range(5)
                ]
    return Profile.from_samples(pd.DataFrame(rows), meta={"backend": "gloo"}, max_bytes=2**22, caveats=caveats or [])


def axis_titles(fig: go.Figure) -> dict:
    """axis name -> title text, for every axis with a title."""
    lay = fig.layout.to_plotly_json()
    return {
        k: v.get("title", {}).get("text")
        for k, v in lay.items()
        if re.fullmatch(r"[xy]axis\d*", k) and v.get("title", {}).get("text")
    }


def assert_units(fig: go.Figure):
    titles = axis_titles(fig)
    assert titles, "figure has no axis titles"
    for name, text in titles.items():
        assert UNIT.search(text) or "GPU count" in text or "configuration" in text, f"{name}: {text!r} has no unit"


def test_distilbert_param_nbytes():
    sizes = wi.distilbert_param_nbytes()
    assert sum(sizes) == 267_820_040 == 66_955_010 * 4
    assert len(sizes) == 104
    assert sizes[:4] == [30522 * 768 * 4, 512 * 768 * 4, 768 * 4, 768 * 4]
    assert sizes[-2:] == [768 * 2 * 4, 2 * 4]  # classifier weight, bias
    assert sum(wi.distilbert_param_nbytes(num_labels=3)) == sum(sizes) + (768 + 1) * 4


def test_model_param_nbytes_matches_the_configs():
    """What lab 1 prints before a run: the parameter count of the config in use, not DistilBERT's always."""
    assert wi.model_param_nbytes("distilbert") == wi.distilbert_param_nbytes()
    # the tiny preset (dtlab.rank.data.TINY_ARCH) built by transformers has 1,011,362 parameters in 40 tensors
    tiny = wi.model_param_nbytes("tiny")
    assert sum(tiny) == 1_011_362 * 4 and len(tiny) == 40
    with pytest.raises(ValueError, match="model must be one of"):
        wi.model_param_nbytes("gpt2")


def test_whatif_single_process_has_no_comm():
    sizes = wi.distilbert_param_nbytes()[::-1]
    r = wi.whatif(0.01, 0.02, 0.003, sizes, 25, 1, LINK)
    assert r["t_comm"] == 0 and r["exposed"] == 0
    assert r["t_step"] == pytest.approx(0.033)
    assert np.isnan(r["overlap"])
    assert r["n_buckets"] == len(r["bucket_nbytes"]) and int(np.sum(r["bucket_nbytes"])) == 267_820_040


def test_whatif_monotonic():
    sizes = wi.distilbert_param_nbytes()[::-1]
    base = wi.whatif(0.01, 0.02, 0.003, sizes, 25, 8, LINK)
    slower = wi.whatif(0.01, 0.02, 0.003, sizes, 25, 8, LINK.replace(beta=BETA * 4))  # a quarter of the bandwidth
    bigger = wi.whatif(0.01, 0.02, 0.003, [2 * s for s in sizes], 25, 8, LINK)  # twice the bytes
    assert slower["t_comm"] > base["t_comm"] and slower["t_step"] >= base["t_step"]
    assert bigger["t_comm"] > base["t_comm"] and bigger["exposed"] >= base["exposed"]
    # ring all-reduce bytes per rank grow with p (2(p-1)/p): more GPUs never means less comm here
    comm = [wi.whatif(0.01, 0.02, 0.003, sizes, 25, p, LINK)["t_comm"] for p in (2, 4, 8, 64)]
    assert comm == sorted(comm)
    # the step never beats compute, and compute does not depend on p (weak scaling)
    assert base["t_step"] >= base["t_comp"] == pytest.approx(0.033)


def test_whatif_sweep_rows():
    sizes = wi.distilbert_param_nbytes()[::-1]
    df = wi.whatif_sweep(0.01, 0.02, 0.003, sizes, [(1, 25), (4, 25), (4, 1024)], LINK)
    assert df["label"].tolist() == ["p=1, 25 MiB", "p=4, 25 MiB", "p=4, 1024 MiB"]
    assert np.allclose(df["t_step"], df["t_comp"] + df["exposed"])


def test_calibration_figure():
    prof = synth_profile(caveats=["gloo on CPU: wall-clock timings, shared cores"])
    fig = cp.calibration_figure(prof)
    names = [t.name for t in fig.data]
    assert any(n.startswith("measured p=2") for n in names)
    assert "model p=2 (fitted range)" in names and "model p=2 (extrapolated)" in names
    assert any(t.name == "model p=2 (extrapolated)" and t.line.dash == "dash" for t in fig.data)
    assert all(t.error_y.array is not None for t in fig.data if t.name.startswith("measured"))
    assert_units(fig)
    assert {"time per call (ms, log)", "model error (%)", "busbw (GB/s)"} <= set(axis_titles(fig).values())
    texts = " ".join(a.text for a in fig.layout.annotations)
    assert "gloo on CPU" in texts and "ring fit" in texts and "µs" in texts and "GB/s" in texts

    one = cp.calibration_figure(prof, op="all_reduce")
    assert "all_reduce" in one.layout.title.text and "ring fit" in one.layout.title.text
    assert not any("all_gather" in (a.text or "") for a in one.layout.annotations)
    with pytest.raises(ValueError, match="not in this profile"):
        cp.calibration_figure(prof, op="broadcast")


def test_calibration_figure_draws_the_samples_and_the_fit_in_their_rows():
    """Every trace of one op's calibration figure against numbers computed here from the samples and the fit: the
    medians and their IQR bars (row 1), the model solid inside the fitted range and dashed outside it (row 1), the
    relative error (row 2), the measured and modelled bus bandwidth (row 3), in that order per p."""
    prof = synth_profile()
    fit = prof.fits["all_reduce"]
    s = prof.samples[prof.samples["op"] == "all_reduce"]
    fig = cp.calibration_figure(prof, op="all_reduce")
    by_name = {t.name: t for t in fig.data}
    expected_order = []
    for p in (1, 2, 4):
        g = s[s["nproc"] == p].groupby("nbytes")["seconds"]
        n = np.array(sorted(s["nbytes"].unique()), dtype=float)
        med = g.median().to_numpy(float)
        measured = next(t for t in fig.data if t.name.startswith(f"measured p={p}:"))
        assert (measured.xaxis, measured.yaxis) == ("x", "y")
        assert np.allclose(measured.x, n) and np.allclose(measured.y, med * 1e3)
        assert np.allclose(measured.error_y.array, (g.quantile(0.75).to_numpy(float) - med) * 1e3)
        assert np.allclose(measured.error_y.arrayminus, (med - g.quantile(0.25).to_numpy(float)) * 1e3)
        if p == 1:
            assert measured.name.endswith("(not modelled: no peer)")
            assert not any(t.name.endswith(f"p={p}") or f"p={p} (" in t.name for t in fig.data if t is not measured)
            continue
        solid, dashed = by_name[f"model p={p} (fitted range)"], by_name[f"model p={p} (extrapolated)"]
        inside = (solid.x >= fit.min_bytes) & (solid.x <= fit.max_bytes)
        model = np.asarray(fit.predict(solid.x, p), dtype=float) * 1e3
        assert (solid.yaxis, dashed.yaxis) == ("y", "y") and dashed.line.dash == "dash"
        assert np.allclose(solid.y[inside], model[inside]) and np.isnan(solid.y[~inside]).all()
        ends = (dashed.x == fit.min_bytes) | (dashed.x == fit.max_bytes)
        assert np.allclose(dashed.y[~inside | ends], model[~inside | ends]) and np.isnan(dashed.y[inside & ~ends]).all()
        error = by_name[f"error p={p}"]
        pred = np.asarray(fit.predict(n, p), dtype=float)
        assert error.yaxis == "y2" and np.allclose(error.y, (pred - med) / med * 100)
        busbw, model_busbw = by_name[f"busbw p={p}"], by_name[f"model busbw p={p}"]
        assert (busbw.yaxis, model_busbw.yaxis) == ("y3", "y3")
        assert np.allclose(busbw.y, np.asarray(cm.busbw("all_reduce", n, med, p)) / 1e9)
        assert np.allclose(model_busbw.y, np.asarray(cm.busbw("all_reduce", solid.x, model / 1e3, p)) / 1e9)
        expected_order += [solid.name, dashed.name, error.name, busbw.name, model_busbw.name]
    names = [t.name for t in fig.data if not t.name.startswith("measured")]
    assert names == expected_order
    assert axis_titles(fig) == {
        "xaxis3": "message size (bytes, log)",
        "yaxis": "time per call (ms, log)",
        "yaxis2": "model error (%)",
        "yaxis3": "busbw (GB/s)",
    }
    title = fig.layout.title.text.replace("<br>", " ")
    assert title.startswith("Calibration (gloo): all_reduce (shaded: fitted size range)")
    assert f"ring fit: α = {fit.alpha * 1e6:.3g} µs" in title and f"rms error {fit.rel_rms:.1%}" in title
    shades = [sh for sh in fig.layout.shapes if sh.type == "rect"]  # the fitted range, in each of the three rows
    assert len(shades) == 3 and all((sh.x0, sh.x1) == (fit.min_bytes, fit.max_bytes) for sh in shades)
    assert any(a.text == f"1/β = {1 / fit.beta / 1e9:.3g} GB/s" for a in fig.layout.annotations)

    both = cp.calibration_figure(prof)  # all_gather in the second column; each legend entry shown once
    gather = [t for t in both.data if t.xaxis in ("x2", "x4", "x6")]
    assert gather and {t.yaxis for t in gather} == {"y2", "y4", "y6"}
    assert all(not t.showlegend for t in gather)
    assert len(both.data) == 2 * len(fig.data)


def test_forms_figure():
    fig = cp.forms_figure(LINK, 25 * 2**20, [1, 2, 4, 8, 64])
    names = [t.name for t in fig.data]
    assert {"textbook total", "ring total", "ring bandwidth term", "textbook latency term"} <= set(names)
    ring = next(t for t in fig.data if t.name == "ring total")
    assert ring.y[0] == 0 and ring.y[-1] == pytest.approx(cm.ring_allreduce(ALPHA, BETA, 25 * 2**20, 64) * 1e3)
    assert_units(fig)


def test_predicted_breakdown_figure():
    df = pd.DataFrame(
        {
            "label": ["p=2, 25 MiB", "p=4, 25 MiB"],
            "t_comp": [0.03, 0.03],
            "t_comm": [0.02, 0.04],
            "exposed": [0.0, 0.012],
        }
    )
    fig = mf.predicted_breakdown_figure(df)
    assert [t.type for t in fig.data] == ["bar", "bar", "scatter"]
    assert list(fig.data[1].y) == pytest.approx([0.0, 12.0])  # ms
    assert fig.layout.barmode == "stack"
    assert_units(fig)
    meas = pd.DataFrame({"label": ["p=4, 25 MiB"], "t_step": [0.05], "t_comm": [0.035]})
    fig = mf.predicted_breakdown_figure(df, meas, highlight="p=4, 25 MiB")
    assert [t.name for t in fig.data[3:]] == ["measured T_step", "measured T_comm"]
    assert list(fig.data[3].y) == pytest.approx([50.0])
    with pytest.raises(ValueError, match="missing columns"):
        mf.predicted_breakdown_figure(df.drop(columns="exposed"))


def test_whatif_timeline_figure():
    r = wi.whatif(0.01, 0.02, 0.003, wi.distilbert_param_nbytes()[::-1], 25, 8, LINK)
    fig = mf.whatif_timeline_figure(r)
    allreduce = next(t for t in fig.data if t.name == "all-reduce (predicted)")
    assert len(allreduce.y) == r["n_buckets"]
    assert "ready" in [t.name for t in fig.data]
    assert_units(fig)


def test_the_phase_bar_is_drawn_by_one_function():
    """Every step timeline's row 'compute' (measured, predicted, tensor-parallel) is `add_phase_bar`'s: bars in ms
    from the step start, an optional phase left out when it lasted no time."""
    from dtlab.viz.figures import add_phase_bar

    fig = go.Figure()
    phases = [("forward", 0.0, 0.01, "#111"), ("injected delay", 0.01, 0.0, "#222"), ("backward", 0.01, 0.02, "#333")]
    add_phase_bar(fig, phases, digits=2, optional=("injected delay",))
    assert [t.name for t in fig.data] == ["forward", "backward"]
    assert (fig.data[1].base[0], fig.data[1].x[0]) == pytest.approx((10.0, 20.0))
    assert fig.data[1].hovertemplate == "backward: %{x:.2f} ms<extra></extra>" and list(fig.data[1].y) == ["compute"]
    add_phase_bar(fig, phases)  # not optional: a phase of no time is drawn
    assert [t.name for t in fig.data[2:]] == ["forward", "injected delay", "backward"]
    r = wi.whatif(0.01, 0.02, 0.003, wi.distilbert_param_nbytes()[::-1], 25, 8, LINK)
    drawn = [t for t in mf.whatif_timeline_figure(r).data if list(t.y) == ["compute"]]
    want = go.Figure()
    end = r["t_fwd"] + r["t_bwd_comp"]
    add_phase_bar(
        want,
        [
            ("forward", 0.0, r["t_fwd"], mf.COLORS["fwd"]),
            ("backward", r["t_fwd"], r["t_bwd_comp"], mf.COLORS["bwd"]),
            ("exposed comm (wait)", end, r["exposed"], mf.COLORS["exposed"]),
            ("optimizer", end + r["exposed"], r["t_opt"], mf.COLORS["opt"]),
        ],
        digits=2,
    )
    assert [t.to_plotly_json() for t in drawn] == [t.to_plotly_json() for t in want.data]


def test_explorer_defaults_and_slider_updates():
    from dtlab.viz.dashboard import explorer

    ex = explorer()
    assert set(ex.sliders) >= {"nproc", "bucket_mb", "alpha_us", "bandwidth_gbs", "form", "sweep"}
    assert set(ex.figures) == {"breakdown", "timeline"}
    from dtlab.viz.livefigure import LiveFigure

    assert isinstance(ex.figures["breakdown"], LiveFigure)
    assert isinstance(ex.figures["breakdown"].figure, go.Figure)
    assert "default, not calibrated" in ex.children[0].value
    assert "placeholder" in ex.children[0].value
    assert ex.sliders["alpha_us"].value == pytest.approx(20.0)
    assert ex.sliders["bandwidth_gbs"].value == pytest.approx(10.0)

    n_redraws = len(ex.redraw_times)
    before = list(ex.figures["breakdown"].data[1].y)  # exposed comm per configuration (ms)
    ex.sliders["bandwidth_gbs"].value = 1.0
    after = list(ex.figures["breakdown"].data[1].y)
    assert after != before and sum(after) > sum(before)
    assert len(ex.redraw_times) == n_redraws + 1 and ex.last_redraw_s > 0
    assert ex.redraw_label.value.startswith("redraw ")

    tl_before = len(ex.figures["timeline"].data[4].y)  # one bar per bucket
    ex.sliders["bucket_mb"].value = 1024.0
    assert len(ex.figures["timeline"].data[4].y) == ex.result["n_buckets"] < tl_before

    ex.sliders["nproc"].value = 1
    assert ex.result["t_comm"] == 0
    ex.sliders["sweep"].value = "bucket_mb"
    assert all(lab.startswith("p=1,") for lab in ex.figures["breakdown"].data[0].x)
    print(f"redraw ms: {[round(t * 1e3, 1) for t in ex.redraw_times]}")  # recorded, not asserted


def test_explorer_with_profile_and_measured():
    from dtlab.viz.dashboard import explorer

    prof = synth_profile(caveats=["gloo on CPU: wall-clock timings"])
    measured = pd.DataFrame(
        {
            "nproc": [2, 4, 4, 8],
            "bucket_mb": [25.0, 25.0, 100.0, 25.0],
            "status": ["ran", "ran", "ran", "skipped"],
            "t_step": [0.04, 0.05, 0.045, np.nan],
            "t_comm": [0.01, 0.02, 0.02, np.nan],
            "t_comp": [0.033, 0.033, 0.033, np.nan],
            "exposed": [0.007, 0.017, 0.012, np.nan],
        }
    )
    ex = explorer(profile=prof, compute=dict(COMPUTE, source="test compute"), measured=measured)
    fit = prof.fits["all_reduce"]
    assert ex.sliders["alpha_us"].value == pytest.approx(fit.alpha * 1e6)
    assert ex.sliders["bandwidth_gbs"].value == pytest.approx(1 / fit.beta / 1e9)
    assert ex.sliders["nproc"].value == 4  # the largest p the profile measured
    header = ex.children[0].value
    assert "fitted from the profile: all_reduce, ring form" in header
    assert "gloo on CPU" in header and "test compute" in header

    names = [t.name for t in ex.figures["breakdown"].data]
    assert names[3:] == ["measured T_step", "measured T_comm", "measured T_comp"]
    step = ex.figures["breakdown"].data[3]
    assert list(step.x) == ["p=2, 25 MiB", "p=4, 25 MiB"]  # bucket 25 MiB matches; the skipped row is dropped
    assert set(step.x) <= set(ex.figures["breakdown"].data[0].x)

    ex.sliders["sweep"].value = "bucket_mb"
    ex.sliders["nproc"].value = 4
    assert list(ex.figures["breakdown"].data[3].x) == ["p=4, 25 MiB", "p=4, 100 MiB"]
    ex.sliders["nproc"].value = 16  # nothing measured there: the traces stay, empty
    assert len(ex.figures["breakdown"].data[3].x or ()) == 0

    alpha_ring = ex.sliders["alpha_us"].value
    ex.sliders["form"].value = "textbook"  # loads the textbook fit of the same samples
    assert ex.sliders["alpha_us"].value != pytest.approx(alpha_ring)
    assert "textbook form" in ex.children[0].value and "refitted from the profile" in ex.children[0].value
    assert ex.result["form"] == "textbook"


def test_explorer_custom_sizes_and_bad_inputs():
    from dtlab.viz.dashboard import explorer

    ex = explorer(compute=COMPUTE, param_nbytes=[4 * 2**20] * 10)
    assert ex.result["n_buckets"] >= 2
    with pytest.raises(ValueError, match="t_opt"):
        explorer(compute={"t_fwd": 0.01, "t_bwd_comp": 0.02})
    with pytest.raises(ValueError, match="measured is missing"):
        explorer(measured=pd.DataFrame({"nproc": [2]}))


def test_compute_from_run():
    from dtlab.results.run import BUCKET_COLUMNS, STEP_COLUMNS, Run

    steps = pd.DataFrame(
        [[r, s, 0.010 + r * 0.001, 0.030, 0.003, 0.045 + r * 0.001, 1.0] for s in range(3) for r in range(2)],
        columns=STEP_COLUMNS,
    )
    buckets = pd.DataFrame(
        [
            {
                "rank": r,
                "step": s,
                "bucket": b,
                "nbytes": 1000,
                "nparams": 1,
                "t_ready": 0.010 + r * 0.001 + 0.01 * (b + 1),
                "t_start": 0.0,
                "t_end": 0.0,
            }
            for s in range(3)
            for r in range(2)
            for b in range(2)
        ],
        columns=BUCKET_COLUMNS,
    )
    empty = pd.DataFrame(columns=STEP_COLUMNS)
    run = Run(
        path="fake",
        config=RunConfig(warmup=1),
        resolved={},
        status={},
        steps=steps,
        baseline_steps=empty,
        buckets=buckets,
        collectives=pd.DataFrame(),
        memory=pd.DataFrame(),
    )
    est = wi.compute_from_run(run)  # no baseline: backward until the last bucket was ready (slowest rank 1)
    assert est["t_fwd"] == pytest.approx(0.011) and est["t_bwd_comp"] == pytest.approx(0.020)
    assert est["t_opt"] == pytest.approx(0.003) and "estimated" in est["source"]
    run.baseline_steps = steps.assign(step=steps["step"] + 10)
    meas = wi.compute_from_run(run)
    assert meas["t_bwd_comp"] == pytest.approx(0.030) and "baseline" in meas["source"]


def browser_echo(slider, value=None):
    """What the browser's slider sends back when it renders (or re-renders) a value: the value snapped to
    its step grid, min + k * step in exponent units, computed in floating point."""
    e = np.log(slider.value if value is None else value) / np.log(slider.base)
    k = np.round((e - slider.min) / slider.step)
    slider.value = float(slider.base ** (slider.min + k * slider.step))


def test_explorer_labels_where_alpha_beta_come_from():
    """A fitted alpha or beta is labelled as fitted (with its form) until the user moves that slider; the
    browser echoing a snapped value is not a move; each slider is labelled on its own."""
    from dtlab.viz.dashboard import explorer

    prof = synth_profile()
    fit = prof.fits["all_reduce"]
    ex = explorer(profile=prof, compute=COMPUTE)

    def label():
        return ex.children[0].value

    # the browser renders every slider and sends back its snapped value: nothing was moved
    for name in ("nproc", "bucket_mb", "alpha_us", "bandwidth_gbs"):
        if name != "nproc":
            browser_echo(ex.sliders[name])
    text = label()
    assert "set by hand" not in text and "moved by you" not in text, text
    assert f"α = {fit.alpha * 1e6:.3g} µs, 1/β = {1 / fit.beta / 1e9:.3g} GB/s</b>: fitted from the profile" in text
    assert "ring form 2(p−1)α + 2(p−1)/p·nβ" in text
    assert not ex.moved("alpha") and not ex.moved("beta")
    assert ex.params()["alpha"] == fit.alpha and ex.params()["beta"] == fit.beta  # the fit itself, not a rounding
    # every log slider starts on its own grid: the echo does not change what it shows (25 MiB stays 25 MiB)
    assert ex.sliders["bucket_mb"].value == pytest.approx(25.0, rel=1e-9)
    assert ex.sliders["alpha_us"].value == pytest.approx(fit.alpha * 1e6, rel=1e-9)

    # the user moves the bandwidth slider: that one, and only that one, says so
    ex.sliders["bandwidth_gbs"].value = 1.0
    text = label()
    assert "<b>1/β = 1 GB/s</b>: moved by you" in text
    assert f"<b>α = {fit.alpha * 1e6:.3g} µs</b>: fitted from the profile" in text
    assert ex.params()["beta"] == pytest.approx(1e-9)
    # and back onto the fitted value (as the browser would send it): fitted again
    browser_echo(ex.sliders["bandwidth_gbs"], 1 / fit.beta / 1e9)
    assert "moved by you" not in label() and ex.params()["beta"] == fit.beta

    # switching the form loads the other form's fit, refitted from the samples, and says so
    ex.sliders["form"].value = "textbook"
    browser_echo(ex.sliders["alpha_us"])
    browser_echo(ex.sliders["bandwidth_gbs"])
    text = label()
    assert "textbook form α(p−1) + nβ/p" in text and "refitted from the profile" in text
    assert "moved by you" not in text and "set by hand" not in text
    # a value the user moved stays theirs across a form switch, labelled as such
    ex.sliders["alpha_us"].value = 500.0
    ex.sliders["form"].value = "ring"
    assert ex.sliders["alpha_us"].value == pytest.approx(500.0)
    assert "<b>α = 500 µs</b>: moved by you" in label() and "ring form" in label()


def test_explorer_labels_defaults_and_reused_fits_as_estimates():
    from dtlab.viz.dashboard import explorer

    text = explorer().children[0].value
    assert "default, not calibrated: an assumed value" in text and "fitted" not in text

    prof = synth_profile()
    prof.samples = prof.samples.iloc[0:0]  # a fit without samples: the other form cannot be refitted
    ex = explorer(profile=prof, compute=COMPUTE)
    ex.sliders["form"].value = "textbook"
    text = ex.children[0].value
    assert "reused under textbook without refitting: an estimate" in text


def test_explorer_state_is_pure_and_says_where_alpha_beta_come_from():
    """The slider/label logic without widgets: values in, model parameters and label lines out."""
    from dtlab.viz.explorer_state import ExplorerState
    from dtlab.viz.loggrid import log_range, on_log_grid

    lo, hi = log_range(25.0, -7, 10, 2, 0.05)  # 25 MiB lies on the bucket slider's grid
    k = (np.log2(25.0) - lo) / 0.05
    assert abs(k - round(k)) < 1e-9 and hi == 10
    assert on_log_grid(10 ** (np.log10(20.0) + 0.009), 20.0, 10, 0.02)  # within half a step: the same value
    assert not on_log_grid(21.0, 20.0, 10, 0.02)

    st = ExplorerState(compute=COMPUTE)
    values = {"nproc": 8, "bucket_mb": 25.0, "alpha_us": 20.0, "bandwidth_gbs": 10.0, "form": "ring", "sweep": "nproc"}
    assert not st.moved("alpha", values) and not st.moved("beta", values)
    assert st.params(values)["alpha"] == st.ref["alpha"]
    assert "default, not calibrated" in st.sources(values)["alpha"]
    moved = dict(values, bandwidth_gbs=1.0)
    assert st.moved("beta", moved) and st.params(moved)["beta"] == pytest.approx(1e-9)
    assert "moved by you" in st.sources(moved)["beta"] and "moved by you" not in st.sources(moved)["alpha"]
    assert st.switch_form("textbook", "ring", moved) == {"alpha_us": pytest.approx(20.0)}  # beta stays the user's
    result, sweep = st.model(values)
    assert result["nproc"] == 8 and "p=8, 25 MiB" in set(sweep["label"])
    with pytest.raises(ValueError, match="which"):
        st.moved("gamma", values)


@pytest.mark.parametrize("module", ["dtlab.model.whatif", "dtlab.viz.explorer_state"])
def test_pure_modules_import_no_figures_or_widgets(module):
    import ast
    import importlib
    import pathlib

    tree = ast.parse(pathlib.Path(importlib.import_module(module).__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"plotly", "ipywidgets", "torch"}


def _values(y) -> list:
    """An array as plotly's JSON carries it: a list, or a typed array (dtype, base64 bytes)."""
    import base64

    if isinstance(y, dict):
        return [float(v) for v in np.frombuffer(base64.b64decode(y["bdata"]), dtype=np.dtype(y["dtype"]))]
    return [float(v) for v in y]


def test_a_reloaded_page_draws_what_the_sliders_show():
    """A move replaces the figure widget's one output with the moved figure: what the browser draws, and what
    a reload draws, are the moved values, not the first ones."""
    from dtlab.viz.dashboard import explorer
    from dtlab.viz.two_level import ASSUMED_LEVELS, two_level_explorer

    ex = explorer(compute=COMPUTE)
    ex.sliders["bandwidth_gbs"].value = 1.0
    live = ex.figures["breakdown"]
    (out,) = live.outputs  # the state a browser draws, and a reload: one output, the moved figure
    shown = out["data"]["application/vnd.plotly.v1+json"]
    assert "1/β = 1 GB/s" in shown["layout"]["title"]["text"]
    assert [_values(t["y"]) for t in shown["data"]] == [list(map(float, t.y)) for t in live.data]
    json.dumps(out)  # JSON as it travels

    box = two_level_explorer(ASSUMED_LEVELS, compute=COMPUTE)
    box.sliders["nodes"].value, box.sliders["gpus_per_node"].value = 1, 3
    (out,) = box.figure.outputs
    assert "1 node(s) x 3 GPU(s)" in out["data"]["application/vnd.plotly.v1+json"]["layout"]["title"]["text"]


def test_a_new_figure_drops_shapes_the_old_one_had():
    from dtlab.viz.livefigure import LiveFigure

    live = LiveFigure(go.Figure(go.Scatter(x=[1, 2], y=[1, 2])).add_vline(x=1.5))
    live.show(go.Figure(go.Scatter(x=[1, 2], y=[3, 4])))
    assert len(live.layout.shapes) == 0 and list(live.data[0].y) == [3, 4]
    (out,) = live.outputs
    assert not out["data"]["application/vnd.plotly.v1+json"]["layout"].get("shapes")


def test_the_compression_slider_at_one_drops_the_encode_cost_and_says_so():
    from dtlab.viz.dashboard import explorer

    comp = {"ratio": 0.0326, "encode_s_per_byte": 4e-9, "source": "measured: powersgd hook in run X"}
    ex = explorer(compute=COMPUTE, compression=comp)
    assert ex.params()["ratio"] == 0.0326 and ex.params()["encode_s_per_byte"] == 4e-9
    assert "r = 0.0326 and encode 4 ns/B" in ex.children[0].value
    ex.sliders["ratio"].value = 1.0
    assert ex.params()["ratio"] == 1.0 and ex.params()["encode_s_per_byte"] == 0.0
    label = ex.children[0].value
    assert "r = 1: no compression and no encode cost" in label and "r = 0.0326 and" not in label
    ex.sliders["ratio"].value = 0.1  # another r: the measured cost is reused, and labelled as an estimate
    assert ex.params()["encode_s_per_byte"] == 4e-9 and "assumed the same at r = 0.1" in ex.children[0].value
    assert len(ex.sliders["ratio"].description) <= 16  # fits its 150 px description column


def test_the_bucket_slider_spans_only_sizes_that_change_the_bucket_count():
    from dtlab.viz.controls import bucket_count, bucket_slider_range
    from dtlab.viz.dashboard import explorer
    from dtlab.viz.two_level import ASSUMED_LEVELS, two_level_explorer

    tiny = wi.model_param_nbytes("tiny")[::-1]  # small tensors first, the 3.9 MB embedding last
    lo, hi = bucket_slider_range(tiny)
    assert bucket_count(tiny, 2**hi) == 1 < bucket_count(tiny, 2 ** (hi - 0.05))
    assert bucket_count(tiny, 2**lo) == bucket_count(tiny, 2**-7) > bucket_count(tiny, 2 ** (lo + 0.05))
    ex = explorer(compute=COMPUTE, param_nbytes=tiny)
    b = ex.sliders["bucket_mb"]
    assert b.max == pytest.approx(hi) and b.value == pytest.approx(2**hi)  # 25 MiB would be one bucket too
    assert all(2**lo <= x <= 2**hi for x in ex.state.sweep_buckets())
    # one tensor: no bucket size changes anything, so there is no bucket control
    one = explorer(compute=COMPUTE, param_nbytes=[4_000_000])
    assert bucket_slider_range([4_000_000]) is None and one.sliders["bucket_mb"].layout.display == "none"
    assert "no bucket control" in one.children[0].value
    box = two_level_explorer(ASSUMED_LEVELS, compute=COMPUTE, param_nbytes=[4_000_000])
    assert box.sliders["bucket_mb"].layout.display == "none"


def test_a_zero_alpha_stays_zero_until_its_slider_moves():
    from dtlab.viz.two_level import ASSUMED_LEVELS, two_level_explorer

    box = two_level_explorer(dict(ASSUMED_LEVELS, alpha_inter=0.0), compute=COMPUTE)
    assert box.sliders["alpha_inter_us"].value == pytest.approx(0.1)  # the slider's bottom
    assert box.levels()[0]["alpha_inter"] == 0.0 and "inter α = 0 µs</b> in the model" in box.children[0].value
    box.sliders["alpha_inter_us"].value = 50.0
    assert box.levels()[0]["alpha_inter"] == pytest.approx(50e-6) and "inter α = 0" not in box.children[0].value


def test_one_node_hides_the_network_controls():
    from dtlab.viz.two_level import ASSUMED_LEVELS, two_level_explorer

    box = two_level_explorer(ASSUMED_LEVELS, compute=COMPUTE)
    net = ("nics_per_node", "alpha_inter_us", "bw_inter_gbs")
    assert all(box.sliders[k].layout.display != "none" for k in net)
    box.sliders["nodes"].value = 1
    assert all(box.sliders[k].layout.display == "none" for k in net) and "<b>one node</b>" in box.children[0].value
    box.sliders["nodes"].value = 3
    assert all(box.sliders[k].layout.display != "none" for k in net)
