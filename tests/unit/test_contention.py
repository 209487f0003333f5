"""Pricing communication under compute contention: a bucket in flight while backward compute runs is priced with
the loaded fit, after it with the idle fit; T_comm is the time in flight (a queued bucket counts from its issue);
the profile keeps loaded fits beside idle ones; the calibration's load fields are checked by name."""

import json

import numpy as np
import pandas as pd
import pytest

from dtlab.config.calibration import CalibConfig
from dtlab.config.run import RunConfig
from dtlab.model.buckets import predict_step, simulate_queue
from dtlab.model.prediction import predict, prediction_summary
from dtlab.model.profile import Profile
from dtlab.results.calibration import load_profile


def test_a_bucket_is_loaded_before_backward_ends_and_idle_after():
    # three buckets, idle 1 s each, loaded 4 s each; backward compute runs until t = 6
    ready, idle, loaded = [0.0, 1.0, 9.0], [1.0, 1.0, 1.0], [4.0, 4.0, 4.0]
    start, end = simulate_queue(ready, idle, loaded=loaded, busy_until=6.0)
    assert start.tolist() == [0.0, 4.0, 9.0]
    # bucket 0: all of it under load (0..4); bucket 1 starts at 4 under load, half done at 6, the other half idle
    # (0.5 s); bucket 2 starts after backward: idle
    assert end.tolist() == pytest.approx([4.0, 6.5, 10.0])
    # without contention every bucket takes its idle time
    assert simulate_queue(ready, idle)[1].tolist() == [1.0, 2.0, 10.0]


def test_loaded_and_busy_until_go_together():
    with pytest.raises(ValueError, match="go together"):
        simulate_queue([0.0], [1.0], loaded=[2.0])
    with pytest.raises(ValueError, match="one duration"):
        simulate_queue([0.0, 1.0], [1.0, 1.0], loaded=[2.0], busy_until=3.0)


def test_t_comm_is_the_time_in_flight_not_the_service_time():
    # two buckets ready together, 1 s each: the second waits 1 s in the queue, in flight from its issue
    pred = predict_step(t_fwd=1.0, t_bwd_comp=1.0, t_opt=0.5, ready=[2.0, 2.0], durations=[1.0, 1.0])
    assert pred["t_busy"] == pytest.approx(2.0) and pred["t_comm"] == pytest.approx(2.0)
    pred = predict_step(t_fwd=1.0, t_bwd_comp=3.0, t_opt=0.5, ready=[1.5, 2.0, 3.5], durations=[1.0, 0.2, 0.2])
    # [1.5, 2.5] and [2.0, 2.7] overlap: in flight 1.5..2.7 and 3.5..3.7
    assert pred["t_comm"] == pytest.approx(1.4) and pred["t_busy"] == pytest.approx(1.4)
    contended = predict_step(
        t_fwd=1.0, t_bwd_comp=3.0, t_opt=0.5, ready=[1.5, 2.0, 3.5], durations=[1.0, 0.2, 0.2], loaded=[2.0, 0.4, 0.4]
    )
    # backward ends at 4.0: bucket 0 loaded 1.5..3.5, bucket 1 loaded 3.5..3.9, bucket 2 from 3.9: a quarter of it
    # loaded (0.1 s of 0.4), the rest idle (0.75 x 0.2 s) -> ends 4.15; in flight 1.5..4.15
    assert contended["t_comm"] == pytest.approx(4.15 - 1.5)
    assert contended["t_step"] > pred["t_step"] - 1e-12


def _samples(alpha, beta, load, sizes=(4096, 65536, 1 << 20, 1 << 22)):
    # ring all-reduce on p = 2: t = 2 alpha + n beta (2(p-1)/p = 1)
    return [
        {"op": "all_reduce", "nbytes": n, "nproc": 2, "seconds": 2 * alpha + beta * n, "load": load, "iter": i}
        for n in sizes
        for i in range(3)
    ]


def _profile():
    s = pd.DataFrame(_samples(10e-6, 1e-9, "idle") + _samples(30e-6, 4e-9, "backward"))
    return Profile.from_samples(s, meta={"backend": "gloo"})


def test_profile_fits_loaded_samples_apart_and_keeps_them_on_disk(tmp_path):
    prof = _profile()
    assert prof.fits["all_reduce"].beta == pytest.approx(1e-9, rel=1e-6)
    assert prof.loaded_fits["all_reduce"].beta == pytest.approx(4e-9, rel=1e-6)
    assert prof.has_load("all_reduce")
    n = 3 << 20
    assert prof.predict("all_reduce", n, 2, load="backward") == pytest.approx(60e-6 + 4e-9 * n, rel=1e-6)
    prof.save(str(tmp_path))
    again = load_profile(str(tmp_path))
    assert again.predict("all_reduce", n, 2, load="backward") == pytest.approx(
        prof.predict("all_reduce", n, 2, load="backward")
    )
    assert json.loads((tmp_path / "profile.json").read_text())["loaded_fits"]["all_reduce"]["beta"] > 0
    idle_only = Profile.from_samples(pd.DataFrame(_samples(10e-6, 1e-9, "idle")))
    assert not idle_only.has_load("all_reduce")
    with pytest.raises(ValueError, match="load='backward'"):
        idle_only.predict("all_reduce", n, 2, load="backward")


class _Run:
    """The parts of a Run that predict reads: one rank-step with two buckets, backward ending at 0.030 s."""

    nproc = 2
    config = RunConfig(strategy="ddp")

    def __init__(self):
        self.steps = pd.DataFrame(
            [{"rank": 0, "step": 1, "t_fwd": 0.010, "t_bwd": 0.030, "t_opt": 0.002, "t_step": 0.060, "loss": 0.69}]
        )
        self.buckets = pd.DataFrame(
            [
                {
                    "rank": 0,
                    "step": 1,
                    "bucket": 0,
                    "nbytes": 1 << 22,
                    "wire_bytes": 1 << 22,
                    "t_ready": 0.015,
                    "t_start": 0.015,
                    "t_end": 0.045,
                },
                {
                    "rank": 0,
                    "step": 1,
                    "bucket": 1,
                    "nbytes": 1 << 20,
                    "wire_bytes": 1 << 20,
                    "t_ready": 0.030,
                    "t_start": 0.030,
                    "t_end": 0.048,
                },
            ]
        )

    def measured_steps(self):
        return self.steps


def test_predict_reports_the_idle_and_the_contended_replay():
    run, prof = _Run(), _profile()
    pred = predict(run, prof)
    row = pred.iloc[0]
    idle = [float(prof.predict("all_reduce", n, 2)) for n in (1 << 22, 1 << 20)]
    loaded = [float(prof.predict("all_reduce", n, 2, load="backward")) for n in (1 << 22, 1 << 20)]
    # idle: bucket 0 0.015..0.015+idle0, bucket 1 from 0.030
    assert row.predicted_t_comm == pytest.approx(idle[0] + idle[1])
    # contended: bucket 0 starts loaded at 0.015; backward ends at 0.030 (the last bucket's ready time)
    e0 = 0.015 + loaded[0] if 0.015 + loaded[0] <= 0.030 else 0.030 + (1 - 0.015 / loaded[0]) * idle[0]
    s1 = max(0.030, e0)
    assert row.contended_t_comm == pytest.approx((s1 + idle[1]) - 0.015)
    assert row.contended_t_comm > row.predicted_t_comm
    assert row.contended_t_comm_error == pytest.approx(row.contended_t_comm / (0.048 - 0.015) - 1)
    summary = prediction_summary(pred)
    assert summary["contended_median_abs_t_comm_error"] == pytest.approx(abs(row.contended_t_comm_error))
    assert (
        "contended_t_step"
        not in predict(run, Profile.from_samples(pd.DataFrame(_samples(10e-6, 1e-9, "idle")))).columns
    )
    assert np.isfinite(row.contended_t_step)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(load="busy"), "load must be one of"),
        (dict(load="backward", load_model="gpt2"), "load_model"),
        (dict(load="backward", load_batch_size=0), "load_batch_size"),
        (dict(load_seq_len=1000), "load_seq_len"),
    ],
)
def test_calibration_load_fields_are_checked_by_name(changes, field):
    with pytest.raises(ValueError, match=field):
        CalibConfig(**changes).validate(cuda_device_count=0)


def test_samples_without_a_load_column_are_idle_and_give_no_loaded_fit():
    s = pd.DataFrame(_samples(10e-6, 1e-9, "idle")).drop(columns="load")
    prof = Profile.from_samples(s)
    assert "all_reduce" in prof.fits and not prof.has_load("all_reduce")


def test_the_explorer_starts_at_the_measured_contention_and_says_where_it_comes_from():
    from dtlab.model.link import Link
    from dtlab.model.sharing import contention_from_profile
    from dtlab.model.whatif import whatif
    from dtlab.viz.explorer_state import ExplorerState

    prof = _profile()
    factor, how = contention_from_profile(prof, 25 * 2**20, 2)
    n = 25 * 2**20
    assert factor == pytest.approx((60e-6 + 4e-9 * n) / (20e-6 + 1e-9 * n)) and "measured" in how
    st = ExplorerState(profile=prof, compute={"t_fwd": 0.01, "t_bwd_comp": 0.02, "t_opt": 0.003})
    assert st.contention0 == pytest.approx(round(contention_from_profile(prof, 28351488.0)[0] / 0.05) * 0.05)
    values = {"nproc": 2, "bucket_mb": 25.0, "alpha_us": 10.0, "bandwidth_gbs": 1.0, "form": "ring", "sweep": "nproc"}
    assert "measured" in st.contention_line(values) and "moved by you" in st.contention_line(
        {**values, "contention": 1.0}
    )
    # no loaded passes in this profile: no stretch assumed, and the label says so; with one, the model uses it
    assert st.stretch == 0.0 and "none assumed" in st.source_html(values)
    prof.meta["load"] = {"stretch": {"per_second": 0.3, "lo": 0.2, "hi": 0.4, "passes": 8, "idle_passes": 4}}
    stretched = ExplorerState(profile=prof, compute={"t_fwd": 0.01, "t_bwd_comp": 0.02, "t_opt": 0.003})
    assert stretched.stretch == 0.3 and "0.30 s of compute lost per s in flight" in stretched.source_html(values)
    assert stretched.model(values)[0]["stretch_s"] > 0 and st.model(values)[0]["stretch_s"] == 0
    # contention slows only what is in flight while backward runs: the step cannot get faster
    args = (0.01, 0.02, 0.003, [4 << 20] * 8, 25.0, 2)
    link = Link(alpha=10e-6, beta=1e-9)
    assert whatif(*args, link.replace(contention=3.0))["t_step"] > whatif(*args, link)["t_step"]
    with pytest.raises(ValueError, match="contention"):
        link.replace(contention=0.5)


def test_a_collective_starts_when_the_last_rank_issues_it_and_the_early_rank_waits():
    from dtlab.model.buckets import replay_ranks

    # rank 0 issues buckets at 0.0 and 1.0, rank 1 at 0.5 and 1.2 (one shared clock); 0.2 s each
    rep = replay_ranks([[0.0, 1.0], [0.5, 1.2]], [0.2, 0.2])
    assert rep["start"].tolist() == pytest.approx([0.5, 1.2]) and rep["end"].tolist() == pytest.approx([0.7, 1.4])
    # rank 0 waited 0.5 s and 0.2 s for rank 1: in flight 0..0.7 and 1.0..1.4; rank 1 only its 2 x 0.2 s
    assert rep["t_comm"].tolist() == pytest.approx([1.1, 0.4])
    loaded = replay_ranks([[0.0, 1.0], [0.5, 1.2]], [0.2, 0.2], loaded=[0.4, 0.4], busy_until=1.3)
    # bucket 0 all under load (0.5..0.9); bucket 1 from 1.2: a quarter loaded (0.1 s of 0.4), the rest idle (0.15 s)
    assert loaded["end"].tolist() == pytest.approx([0.9, 1.45])


class _TwoRanks(_Run):
    """Two ranks of one step on a shared clock: rank 1 started 0.010 s later and issues each bucket later."""

    nproc = 2

    def __init__(self):
        self.steps = pd.DataFrame(
            [
                {
                    "rank": 0,
                    "step": 1,
                    "t_fwd": 0.010,
                    "t_bwd": 0.030,
                    "t_opt": 0.002,
                    "t_step": 0.060,
                    "time": 100.060,
                },
                {
                    "rank": 1,
                    "step": 1,
                    "t_fwd": 0.010,
                    "t_bwd": 0.035,
                    "t_opt": 0.002,
                    "t_step": 0.052,
                    "time": 100.062,
                },
            ]
        )
        rows = []
        # ready times from each rank's step start (rank 0's at 100.000, rank 1's at 100.010: time - t_step above)
        for r, readies in ((0, (0.015, 0.030)), (1, (0.020, 0.032))):
            for k, (ready, n) in enumerate(zip(readies, (1 << 22, 1 << 20))):
                rows.append(
                    {
                        "rank": r,
                        "step": 1,
                        "bucket": k,
                        "nbytes": n,
                        "wire_bytes": n,
                        "t_ready": ready,
                        "t_start": ready,
                        "t_end": ready + 0.02,
                    }
                )
        self.buckets = pd.DataFrame(rows)


def test_predict_replays_every_rank_on_the_shared_clock():
    from dtlab.model.buckets import replay_ranks

    run, prof = _TwoRanks(), _profile()
    row = predict(run, prof).iloc[0]
    # each rank's step start = its end stamp - t_step: rank 0 at 100.000, rank 1 at 100.010
    issues = [[100.015, 100.030], [100.030, 100.042]]
    idle = [float(prof.predict("all_reduce", n, 2)) for n in (1 << 22, 1 << 20)]
    loaded = [float(prof.predict("all_reduce", n, 2, load="backward")) for n in (1 << 22, 1 << 20)]
    rep = replay_ranks(issues, idle)
    assert row.predicted_t_comm == pytest.approx(rep["t_comm"].max())
    # T_step: each rank's compute to its last bucket, the later of that and the last end, its optimizer
    t_steps = [max(100.030, rep["end"][-1]) + 0.002 - 100.000, max(100.042, rep["end"][-1]) + 0.002 - 100.010]
    assert row.predicted_t_step == pytest.approx(max(t_steps))
    con = replay_ranks(issues, idle, loaded=loaded, busy_until=100.042)
    assert row.contended_t_comm == pytest.approx(con["t_comm"].max()) and row.contended_t_comm > row.predicted_t_comm
