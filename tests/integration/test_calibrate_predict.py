"""A real 2-process calibration sweep, DDP prediction from its profile, and sweeps with reuse and skips."""

import pytest

import dtlab
from dtlab.intervals import union_length


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "p"
    # small sizes, fast on 2 cores, up to 4 MiB: there the bandwidth term dwarfs the timing noise of a busy
    # machine (up to 1 MiB only, a noisy sweep once fitted beta = 0 and predicted 1 GiB as fast as 4 KiB)
    # load='backward' with the tiny model: every size is also timed beside a replayed backward pass
    return dtlab.calibrate(
        nproc=2,
        ops=("all_reduce", "reduce_scatter", "all_gather"),
        sizes=[2**k for k in range(12, 23, 2)],
        iters=4,
        warmup=2,
        out=str(out),
        load="backward",
        load_model="tiny",
        load_batch_size=4,
        load_seq_len=32,
        progress=False,
    )


def test_real_calibration_profile(profile):
    assert set(profile.fits) == {"all_reduce", "reduce_scatter", "all_gather"}
    s = profile.samples
    assert set(s["nbytes"]) == {2**k for k in range(12, 23, 2)}
    assert (s.groupby(["op", "nbytes", "load"]).size() == 4).all()  # slowest rank per timed iteration
    assert set(s["load"]) == {"idle", "backward"} and set(profile.loaded_fits) == set(profile.fits)
    assert profile.meta["load"]["model"] == "tiny" and all(n > 0 for n in profile.meta["load"]["passes"].values())
    # the passes also measured what the transfers cost the compute beside them, and a rank's compute alone: 3
    # rounds, each with an idle pass before and after the loaded ones and one pass alone per rank
    stretch, alone = profile.meta["load"]["stretch"], profile.meta["load"]["alone"]
    assert stretch["idle_passes"] == 2 * 3 * 2 and stretch["passes"] > 0 and 0 <= stretch["lo"] <= stretch["hi"]
    assert alone["ranks"] == 2 and alone["passes"] == 2 * 3 * 2 + 3 * 2 and alone["ratio"] > 0
    assert any("per s of communication in flight" in c for c in profile.caveats)
    assert (s["seconds"] > 0).all()
    for f in profile.fits.values():
        assert f.n_points == 6 and f.form == "ring"
    assert profile.meta["backend"] == "gloo" and profile.meta["world_size"] == 2
    assert profile.meta["versions"]["torch"]
    assert any("reduce_scatter" in c for c in profile.caveats)  # gloo honesty note
    # predictions are positive seconds and grow with size in the bandwidth-bound range
    assert 0 < profile.predict("all_reduce", 2**12, 2) < profile.predict("all_reduce", 2**30, 2)


def test_profile_reloads_from_disk(profile):
    again = dtlab.load_profile(profile.meta["calibration"]["out"])
    assert again.predict("all_reduce", 123456, 2) == pytest.approx(profile.predict("all_reduce", 123456, 2))


def test_predict_ddp_run(profile, tiny_run):
    pred = dtlab.predict(tiny_run, profile)
    cols = {
        "measured_t_step",
        "predicted_t_step",
        "measured_t_comm",
        "predicted_t_comm",
        "measured_exposed",
        "predicted_exposed",
        "contended_t_step",
        "contended_t_comm",
    }
    assert cols <= set(pred.columns)
    assert len(pred) == tiny_run.config.steps - tiny_run.config.warmup
    assert (pred["predicted_t_step"] > 0).all() and (pred["predicted_t_comm"] > 0).all()
    # Replay each step by hand, every rank on the wall clock the ranks stamped (step start = stamp - t_step): a
    # bucket's all-reduce, priced at its own bytes, starts once the last rank has issued it and the previous one
    # has ended (one channel), loaded while any rank still computes backward, idle after; a rank's T_comm is the
    # union of its [issue, end]. Pricing all bytes as one message, a queue that lets all-reduces overlap, one
    # rank's clock for all, or ignoring a rank's late issue would each fail this.
    steps = tiny_run.steps.set_index(["rank", "step"])
    for row in pred.itertuples():
        b = tiny_run.buckets[tiny_run.buckets["step"] == row.step]
        ranks = sorted(b["rank"].unique())
        issue = {
            r: steps.loc[(r, row.step), "time"]
            - steps.loc[(r, row.step), "t_step"]
            + b[b["rank"] == r].sort_values("bucket")["t_start"].to_numpy()
            for r in ranks
        }
        sizes = b[b["rank"] == ranks[0]].sort_values("bucket")["nbytes"].to_numpy()
        busy_until = max(v.max() for v in issue.values())
        for load, t_comm in (("idle", row.predicted_t_comm), ("backward", row.contended_t_comm)):
            end, ends = float("-inf"), []
            for k, n in enumerate(sizes):
                idle = float(profile.predict("all_reduce", int(n), 2))
                busy = float(profile.predict("all_reduce", int(n), 2, load=load))
                start = max(max(v[k] for v in issue.values()), end)
                end = (
                    start + idle
                    if start >= busy_until
                    else start + busy
                    if start + busy <= busy_until
                    else busy_until + (1 - (busy_until - start) / busy) * idle
                )
                ends.append(end)
            assert t_comm == pytest.approx(max(union_length(zip(issue[r], ends)) for r in ranks), rel=1e-9)


def test_run_whatif_on_a_real_run_names_what_it_used(profile, tiny_run):
    """The documented what-if call on a real 2-rank run and a loaded calibration of the same host: a breakdown in
    seconds with its band, and the inputs it used named (every one this run and profile measured)."""
    w = tiny_run.whatif(profile)
    # here: the profile was calibrated on the run's own host, so its cores, load and wait are the run's
    assert w.setting == {"bucket_mb": 0.05, "nproc": 2, "nodes": 1, "ranks": 2, "ratio": 1.0, "here": True}
    assert w.t_step > 0 and w.t_comm > 0 and w.t_step == pytest.approx(w.t_comp + w.exposed)
    assert w.lo["t_step"] <= w.t_step <= w.hi["t_step"]
    used = "\n".join(w.used)
    for what in (
        "compute: forward",
        "no-op comm hook baseline of",
        "bucket readiness: the run's measured ready curve",
        "cores: 2 ranks shared",
        "a rank alone",
        "measured wait",
        "link: all_reduce ring fit",
        "contention: measured",
        "stretch: measured",
    ):
        assert what in used, what
    assert not any("baseline" in n or "wait" in n for n in w.not_used)
    # more buckets at a smaller cap, and a 4-rank step on the same 2 cores with slower compute (the fair share)
    small, four = tiny_run.whatif(profile, bucket_mb=0.01), tiny_run.whatif(profile, nproc=4)
    assert small.detail["n_buckets"] > w.detail["n_buckets"] and four.t_comp > w.t_comp
    assert dtlab.whatif(tiny_run, profile).t_step == w.t_step


def test_sweep_reuses_and_skips(tmp_path, capsys):
    base = dtlab.tiny(steps=2, baseline_steps=0, bucket_mb=0.05)
    root = str(tmp_path / "sw")
    df = dtlab.sweep(base, nproc=[2], bucket_mb=[0.05, 1.0], out=root, progress=False)
    assert list(df["status"]) == ["ran", "ran"]
    assert (df["t_step"] > 0).all() and (df["t_comm"] > 0).all()
    again = dtlab.sweep(base, nproc=[2], bucket_mb=[0.05], out=root, progress=False)
    assert list(again["status"]) == ["reused"]
    assert again["t_step"].iloc[0] == df["t_step"].iloc[0]
    skipped = dtlab.sweep(base.replace(backend="nccl"), nproc=[2], bucket_mb=[1.0], out=root, progress=False)
    assert skipped["status"].iloc[0] == "skipped" and "nccl" in skipped["reason"].iloc[0]
