"""The compression lever in the model: r scales the bandwidth term only, the encode cost lands on the compute
path, and the explorer's r slider (started from a measured hook) drives both figures."""

import numpy as np
import pytest

from dtlab.model.link import Link
from dtlab.model.whatif import whatif, whatif_sweep
from dtlab.viz.dashboard import explorer

SIZES = [4 * 2**20, 2**20, 3 * 2**20, 512]  # gradient bytes in ready order


COMPUTE = {"t_fwd": 0.01, "t_bwd_comp": 0.02, "t_opt": 0.003}


def _w(**kw):
    args = dict(bucket_mb=1.0, nproc=4, alpha=0.0, beta=1e-9)
    args.update(kw)
    return whatif(
        COMPUTE["t_fwd"],
        COMPUTE["t_bwd_comp"],
        COMPUTE["t_opt"],
        SIZES,
        args.pop("bucket_mb"),
        args.pop("nproc"),
        Link(alpha=args.pop("alpha"), beta=args.pop("beta")),
        **args,
    )


def test_ratio_scales_the_bandwidth_term_not_the_latency():
    full, half = _w(), _w(ratio=0.5)
    assert np.allclose(half["durations"], full["durations"] / 2)  # alpha = 0: all bandwidth
    assert list(half["bucket_nbytes"]) == list(full["bucket_nbytes"])  # the buckets still hold every gradient
    a_full, a_half = _w(alpha=1e-3), _w(alpha=1e-3, ratio=0.5)
    latency = a_full["durations"] - full["durations"]  # 2(p-1) alpha per bucket in the ring form
    assert np.allclose(a_half["durations"], latency + full["durations"] / 2)


def test_encode_cost_is_added_to_backward_compute():
    c = 1e-9  # s/B
    base, enc = _w(ratio=0.5), _w(ratio=0.5, encode_s_per_byte=c)
    assert enc["t_bwd_comp"] == pytest.approx(base["t_bwd_comp"] + c * sum(SIZES))
    assert enc["t_comp"] == pytest.approx(base["t_comp"] + c * sum(SIZES))
    sweep = whatif_sweep(
        0.01, 0.02, 0.003, SIZES, [(2, 1.0), (4, 1.0)], Link(alpha=0.0, beta=1e-9), 0.5, encode_s_per_byte=c
    )
    assert sweep["t_comp"].iloc[0] == pytest.approx(enc["t_comp"])


@pytest.mark.parametrize(
    "kw", [dict(ratio=0.0), dict(ratio=1.5), dict(ratio=float("nan")), dict(encode_s_per_byte=-1.0)]
)
def test_bad_lever_values_are_refused(kw):
    with pytest.raises(ValueError, match="ratio|encode_s_per_byte"):
        _w(**kw)


def test_explorer_r_slider_starts_at_the_measured_ratio_and_drives_the_model():
    comp = {"ratio": 0.031, "encode_s_per_byte": 2e-10, "source": "measured: powersgd hook in runs/x"}
    ex = explorer(compute=COMPUTE, param_nbytes=SIZES, compression=comp)
    assert ex.params()["ratio"] == 0.031  # exactly the measured r, not the slider's rounded copy
    assert "compression</b>: r = 0.031" in ex.children[0].value and "runs/x" in ex.children[0].value
    assert ex.result["t_bwd_comp"] == pytest.approx(COMPUTE["t_bwd_comp"] + 2e-10 * sum(SIZES))
    d_measured = ex.result["durations"].copy()
    ex.sliders["ratio"].value = 1.0  # the student moves r back to "no compression"
    assert ex.params()["ratio"] == 1.0
    assert ex.result["durations"].sum() > d_measured.sum()
    assert "compression r = 1" in ex.figures["breakdown"].layout.title.text
    plain = explorer(compute=COMPUTE, param_nbytes=SIZES)
    assert plain.params()["ratio"] == 1.0 and plain.params()["encode_s_per_byte"] == 0.0
    with pytest.raises(ValueError, match="ratio"):
        explorer(compute=COMPUTE, param_nbytes=SIZES, compression={"ratio": 2.0, "source": "x"})
