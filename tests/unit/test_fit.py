import json
import os

import numpy as np
import pandas as pd
import pytest

from dtlab.model import costmodel as cm
from dtlab.model.fit import AlphaBetaFit, fit_alpha_beta
from dtlab.model.profile import Profile
from dtlab.results.calibration import load_profile

ALPHA, BETA = 2e-5, 1e-10  # s, s/B (10 GB/s)


SIZES = [2**k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB


def synth(op="all_reduce", form="ring", nprocs=(4,), noise=0.0, reps=20, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for p in nprocs:
        for n in SIZES:
            t = cm.collective_time(op, form, ALPHA, BETA, n, p)
            for i in range(reps):
                rows.append(
                    {"op": op, "nbytes": n, "nproc": p, "iter": i, "seconds": t * (1 + noise * rng.standard_normal())}
                )
    return pd.DataFrame(rows)


@pytest.mark.parametrize("form", ["ring", "textbook"])
def test_exact_recovery(form):
    f = fit_alpha_beta(synth(form=form, nprocs=(2, 4, 8), reps=3), "all_reduce", form=form)
    assert f.alpha == pytest.approx(ALPHA, rel=1e-9)
    assert f.beta == pytest.approx(BETA, rel=1e-9)
    assert f.rel_rms < 1e-9
    assert f.n_points == 3 * len(SIZES) and f.n_samples == 3 * len(SIZES) * 3
    assert f.form == form and f.warnings == []


def test_noisy_recovery_within_ci():
    f = fit_alpha_beta(synth(op="all_gather", noise=0.05, seed=1), "all_gather")
    assert f.alpha_ci[0] <= ALPHA <= f.alpha_ci[1]
    assert f.beta_ci[0] <= BETA <= f.beta_ci[1]
    assert f.alpha == pytest.approx(ALPHA, rel=0.1)
    assert f.beta == pytest.approx(BETA, rel=0.05)
    assert 0 < f.rel_rms < 0.05
    r = f.residuals[0]
    assert set(r) >= {"nbytes", "nproc", "measured", "predicted", "rel_error"}
    assert r["count"] == 20


def test_median_resists_outliers():
    df = synth(reps=5)
    # one iteration per size is 100x slower (e.g. a first-call effect)
    df.loc[df["iter"] == 0, "seconds"] *= 100
    f = fit_alpha_beta(df, "all_reduce")
    assert f.alpha == pytest.approx(ALPHA, rel=1e-9)


def test_size_range_restriction():
    df = synth()
    f = fit_alpha_beta(df, "all_reduce", min_bytes=2**14, max_bytes=2**20)
    assert f.n_points == 4  # 2^14, 2^16, 2^18, 2^20
    assert (f.min_bytes, f.max_bytes) == (2**14, 2**20)
    assert all(2**14 <= r["nbytes"] <= 2**20 for r in f.residuals)


def test_too_few_points():
    with pytest.raises(ValueError, match="min_bytes"):
        fit_alpha_beta(synth(), "all_reduce", min_bytes=2**24, max_bytes=2**26)


def test_single_process_points_are_ignored():
    df = pd.concat([synth(), synth(nprocs=(1,)).assign(seconds=1e-5)])
    f = fit_alpha_beta(df, "all_reduce")
    assert all(r["nproc"] == 4 for r in f.residuals)
    assert f.alpha == pytest.approx(ALPHA, rel=1e-9)


def test_negative_alpha_is_kept_and_flagged():
    df = synth()
    df["seconds"] = cm.collective_time("all_reduce", "ring", -1e-6, BETA, df["nbytes"], 4)
    df = df[df["nbytes"] >= 2**20]  # keep times positive
    f = fit_alpha_beta(df, "all_reduce")
    assert f.alpha == pytest.approx(-1e-6, rel=1e-6)
    assert any("alpha" in w for w in f.warnings)


def test_bad_arguments():
    df = synth()
    with pytest.raises(ValueError, match="op"):
        fit_alpha_beta(df, "broadcast")
    with pytest.raises(ValueError, match="form"):
        fit_alpha_beta(df, "all_reduce", form="tree")
    with pytest.raises(ValueError, match="columns"):
        fit_alpha_beta(df.drop(columns=["seconds"]), "all_reduce")
    with pytest.raises(ValueError, match="confidence"):
        fit_alpha_beta(df, "all_reduce", confidence=1.0)


def test_fit_dict_round_trip_and_predict():
    f = fit_alpha_beta(synth(noise=0.02), "all_reduce")
    d = json.loads(json.dumps(f.to_dict()))
    g = AlphaBetaFit.from_dict(d)
    assert g == f
    # predict uses the fitted form: ring all_reduce at p=4, n=1e6
    expect = 6 * f.alpha + 1.5 * f.beta * 1e6
    assert g.predict(1e6, 4) == pytest.approx(expect)
    assert np.allclose(g.predict(np.array([1e3, 1e6]), 4), [6 * f.alpha + 1.5e3 * f.beta, expect])


def test_profile_save_load_round_trip(tmp_path):
    df = pd.concat([synth("all_reduce"), synth("all_gather"), synth("reduce_scatter")], ignore_index=True)
    meta = {"host": "testbox", "backend": "gloo", "nproc": 4, "versions": {"numpy": np.__version__}}
    prof = Profile.from_samples(df, meta, form="textbook", caveats=["gloo on CPU: shared memory"])
    assert sorted(prof.fits) == ["all_gather", "all_reduce", "reduce_scatter"]
    assert all(f.form == "textbook" for f in prof.fits.values())
    out = prof.save(tmp_path / "prof")
    assert os.path.basename(out) == "profile.json"

    for p in (tmp_path / "prof", out):
        back = load_profile(p)
        assert back.meta == meta
        assert back.caveats == prof.caveats
        assert back.fits == prof.fits
        assert len(back.samples) == len(df)
        assert back.predict("all_gather", 1e6, 4) == pytest.approx(prof.predict("all_gather", 1e6, 4))


def test_profile_missing_op_and_unfittable_op():
    df = pd.concat([synth("all_reduce"), synth("all_gather").head(20)], ignore_index=True)
    prof = Profile.from_samples(df, {"host": "x"})
    assert list(prof.fits) == ["all_reduce"]
    assert any("all_gather" in c for c in prof.caveats)
    with pytest.raises(ValueError, match="all_reduce"):  # lists the fitted ops
        prof.predict("all_gather", 1e6, 4)


def test_load_profile_bad_path(tmp_path):
    with pytest.raises(ValueError, match="path"):
        load_profile(tmp_path / "nope")


def _two_regime_samples(seed=0, noise=0.02):
    # below 1 MiB: alpha 50 us, 4 GB/s; from 1 MiB: alpha 2 ms, 1 GB/s (a protocol switch), ring form, p=2
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(12, 27):
        n = 2**k
        a, b = (50e-6, 1 / 4e9) if n < 2**20 else (2e-3, 1 / 1e9)
        t = a * 2 * (2 - 1) + b * 2 * (2 - 1) / 2 * n
        for _ in range(7):
            rows.append({"op": "all_reduce", "nbytes": n, "nproc": 2, "seconds": t * rng.lognormal(0, noise)})
    return pd.DataFrame(rows)


def test_piecewise_finds_the_protocol_switch():
    from dtlab.model.fit import fit_piecewise

    segs = fit_piecewise(_two_regime_samples(), "all_reduce")
    assert len(segs) == 2
    assert segs[0].max_bytes == 2**19 and segs[1].min_bytes == 2**20
    assert segs[0].alpha_ci[0] <= 50e-6 <= segs[0].alpha_ci[1]
    assert segs[1].beta_ci[0] <= 1e-9 <= segs[1].beta_ci[1]


def test_piecewise_keeps_one_regime_when_one_fits():
    from dtlab.model.fit import fit_piecewise

    rng = np.random.default_rng(1)
    rows = [
        {"op": "all_reduce", "nbytes": 2**k, "nproc": 2, "seconds": (2 * 30e-6 + 2**k / 5e9) * rng.lognormal(0, 0.02)}
        for k in range(12, 27)
        for _ in range(7)
    ]
    assert len(fit_piecewise(pd.DataFrame(rows), "all_reduce")) == 1


def test_profile_predicts_by_regime_and_round_trips(tmp_path):
    from dtlab.model.profile import Profile
    from dtlab.results.calibration import load_profile

    prof = Profile.from_samples(_two_regime_samples(), meta={"backend": "synthetic"})
    true_big = 2e-3 * 2 + 1e-9 * 3 * 2**20  # 3 MiB, second regime, ring p=2
    true_small = 50e-6 * 2 + 3 * 2**16 / 4e9  # 192 KiB, first regime
    assert prof.predict("all_reduce", 3 * 2**20, 2) == pytest.approx(true_big, rel=0.05)
    assert prof.predict("all_reduce", 3 * 2**16, 2) == pytest.approx(true_small, rel=0.05)
    # the single straight line cannot do both
    single = [prof.predict("all_reduce", n, 2, piecewise=False) for n in (3 * 2**20, 3 * 2**16)]
    assert max(abs(single[0] / true_big - 1), abs(single[1] / true_small - 1)) > 0.1
    again = load_profile(prof.save(str(tmp_path)))
    assert len(again.segments["all_reduce"]) == 2
    assert again.predict("all_reduce", 3 * 2**20, 2) == pytest.approx(prof.predict("all_reduce", 3 * 2**20, 2))
