"""What ranks sharing a machine cost each other's compute: the stretch of backward by communication in flight,
a rank's compute alone against all together, and how the what-if applies both (dtlab.model.sharing)."""

import numpy as np
import pytest

from dtlab.model import sharing as sh
from dtlab.model import whatif as wi
from dtlab.model.link import Link

MIB = 2**20


def _passes(per_second=0.3, base=1.0, ranks=(0, 1)):
    """Idle passes of `base` s and loaded ones whose compute grows by per_second x their in-flight seconds; the
    hooks' waits come on top of the wall time (they are not compute)."""
    out = []
    for r in ranks:
        out += [dict(rank=r, idle=True, seconds=base + d, waited=0.0, in_flight=0.0) for d in (-0.01, 0.0, 0.01)]
        for f, w in ((0.2, 0.0), (0.5, 0.3), (0.9, 1.2), (0.4, 0.05)):
            out.append(dict(rank=r, idle=False, seconds=base + per_second * f + w, waited=w, in_flight=f))
    return out


def test_fit_stretch_is_compute_lost_per_second_in_flight_waits_taken_out():
    fit = sh.fit_stretch(_passes(0.3))
    assert fit["per_second"] == pytest.approx(0.3)  # counting the waits as compute would give about 1.3
    assert fit["lo"] == pytest.approx(0.3) and fit["hi"] == pytest.approx(0.3)  # no noise: no spread
    assert fit["idle_pass_s"] == pytest.approx(1.0) and fit["passes"] == 8 and fit["idle_passes"] == 6


def test_fit_stretch_compares_each_rank_with_its_own_idle_passes():
    slow = [dict(p, seconds=p["seconds"] + 0.5) for p in _passes(0.2, ranks=(1,))]  # rank 1 is 0.5 s slower
    fit = sh.fit_stretch(_passes(0.2, ranks=(0,)) + slow)
    assert fit["per_second"] == pytest.approx(0.2)  # one pooled idle median would read rank 1's 0.5 s as stretch


def test_fit_stretch_needs_idle_and_loaded_passes():
    loaded_only = [p for p in _passes() if not p["idle"]]
    assert sh.fit_stretch(loaded_only) is None
    nothing_in_flight = [dict(p, in_flight=0.0) for p in _passes()]
    assert sh.fit_stretch(nothing_in_flight) is None
    faster = sh.fit_stretch(_passes(-0.2))  # noise can make loaded passes faster: no negative stretch
    assert faster["per_second"] == 0.0


def test_fit_alone_is_the_median_lone_pass_over_the_median_shared_one():
    passes = [dict(rank=r, idle=True, seconds=s) for r in (0, 1) for s in (1.0, 1.1, 1.2)]
    passes += [dict(rank=r, idle=True, solo=True, seconds=s) for r in (0, 1) for s in (0.9, 0.95)]
    passes += [dict(rank=0, idle=False, seconds=9.0, in_flight=1.0)] * 4  # loaded: neither alone nor together
    got = sh.fit_alone(passes)
    assert got["ratio"] == pytest.approx(0.925 / 1.1) and got["ranks"] == 2 and got["passes"] == 10
    assert sh.fit_alone([p for p in passes if not p.get("solo")]) is None


def test_stretched_backward_solves_for_its_own_length():
    # one bucket ready as backward starts, in service longer than backward: in flight all the pass long, so
    # b = 1 + s b, b = 1 / (1 - s)
    b, ready = sh.stretched_backward(0.5, 1.0, [0.5], [5.0], stretch=0.5)
    assert b == pytest.approx(2.0, rel=1e-6) and ready == pytest.approx([0.5])
    # ready as backward ends: nothing in flight beside it, nothing lost
    b, ready = sh.stretched_backward(0.5, 1.0, [1.5], [5.0], stretch=0.5)
    assert b == pytest.approx(1.0) and ready == pytest.approx([1.5])
    # ready halfway, 0.25 s of service: b = 1 + 0.5 x 0.25; the ready time stays at half the pass
    b, ready = sh.stretched_backward(0.0, 1.0, [0.5], [0.25], stretch=0.5)
    assert b == pytest.approx(1.125, rel=1e-6) and ready == pytest.approx([0.5625], rel=1e-6)
    assert sh.stretched_backward(0.0, 1.0, [0.5], [0.25], stretch=0.0)[0] == 1.0
    # stretch 1 with a collective in flight the whole pass: backward ends when it ends, its own 1 s done then:
    # b = 1 + min(b, 5) has its solution at b = 6 (the 5 s collective from the pass's start, then 1 s)
    assert sh.stretched_backward(0.5, 1.0, [0.5], [5.0], stretch=1.0)[0] == pytest.approx(6.0, rel=1e-9)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="stretch"):
            sh.stretched_backward(0.0, 1.0, [0.5], [0.25], stretch=bad)


def test_whatif_with_stretch_lengthens_backward_by_what_overlaps_it():
    sizes = [10 * MIB] * 8
    link = Link(alpha=0.0, beta=0.05 / (10 * MIB))  # 0.05 s per 10 MiB bucket (ring, p = 2: 2 (p-1)/p = 1)
    plain = wi.whatif(0.1, 1.0, 0.1, sizes, 10, 2, link)
    got = wi.whatif(0.1, 1.0, 0.1, sizes, 10, 2, link.replace(stretch=0.4))
    assert plain["stretch_s"] == 0.0 and got["stretch_s"] > 0
    # 7 buckets in service inside backward (the last is ready as it ends), 0.05 s each, and backward growing
    # with them: stretch_s = 0.4 x 7 x 0.05 = 0.14 s
    assert got["stretch_s"] == pytest.approx(0.4 * 7 * 0.05, rel=1e-6)
    assert got["t_comp"] == pytest.approx(plain["t_comp"] + got["stretch_s"])
    assert got["t_step"] == pytest.approx(plain["t_step"] + got["stretch_s"])
    lone = wi.whatif(0.1, 1.0, 0.1, sizes, 10, 1, link.replace(stretch=0.4))
    assert lone["stretch_s"] == 0.0  # one rank: nothing in flight
    with pytest.raises(ValueError, match="stretch"):
        link.replace(stretch=-0.1)  # refused even where it would change nothing
    sweep = wi.whatif_sweep(0.1, 1.0, 0.1, sizes, [(2, 10)], link.replace(stretch=0.4))
    assert sweep["t_step"].iloc[0] == pytest.approx(got["t_step"])


CPU2 = {"cores": 2, "nproc": 2, "threads_per_rank": 1}


def test_cpu_share_scale_uses_the_measured_lone_rank():
    alone = {"ranks": 2, "ratio": 0.95}
    assert sh.cpu_share_scale(1, dict(CPU2, alone=alone)) == pytest.approx(0.95)  # fair share alone: 1.0
    assert sh.cpu_share_scale(3, dict(CPU2, alone=alone)) == pytest.approx(1.5)  # fair share from 2 ranks on
    assert sh.cpu_share_scale(2, dict(CPU2, nproc=1, alone=alone)) == pytest.approx(1 / 0.95)
    assert sh.cpu_share_scale(2, dict(CPU2, alone=alone)) == 1.0
    assert wi.cpu_share_scale is sh.cpu_share_scale  # the what-if's own name for it still works
    for bad in ({"ranks": 2, "ratio": 0}, {"ranks": 1, "ratio": 0.9}):
        with pytest.raises(ValueError, match="alone"):
            sh.cpu_share_scale(1, dict(CPU2, alone=bad))


class _Profile:
    def __init__(self, meta):
        self.meta = meta


def test_stretch_from_profile_says_where_it_comes_from():
    st = sh.fit_stretch(_passes(0.3))
    r, how = sh.stretch_from_profile(_Profile({"load": {"stretch": st}}))
    assert r == pytest.approx(0.3) and "measured" in how and "8 backward passes" in how
    r, how = sh.stretch_from_profile(_Profile({}))
    assert r == 0.0 and "none assumed" in how
    assert np.isfinite(sh.stretch_from_profile(None)[0])
