"""The run's what-if (dtlab.results.whatif, `run.whatif`): what a hand-made run and a hand-made Profile give, which
inputs it names as used and not used, its band, a two-level link across nodes, and bad settings refused by name."""

import math

import pandas as pd
import pytest

import dtlab
from dtlab.config.run import RunConfig
from dtlab.model import whatif as wi
from dtlab.model.link import Link, TwoLevelLink
from dtlab.results.run import BUCKET_COLUMNS, STEP_COLUMNS, Run
from tests.unit.test_link import MIB, hand_profile

RESOLVED = {
    "param_nbytes": [MIB, MIB, 2 * MIB],  # registration order; DDP readies them in reverse
    "world_size": 2,
    "host": "vm",
    "backend": "gloo",
    "device_type": "cpu",
    "cpu_cores": 2,
    "torch_threads_per_rank": 1,
}


def fake_run(baseline=True, resolved=None) -> Run:
    """2 ranks, 3 measured steps of 1 + 3 + 0.5 s compute and 4.6 s (rank 1) steps, one 4 MiB bucket at 25 MiB
    ready as backward ends; no-op hook steps of 4.0 s paired with them (when `baseline`)."""
    steps = pd.DataFrame(
        [[r, s, 1.0, 3.0, 0.5, 4.5 + r * 0.1, 1.0] for s in range(4) for r in range(2)], columns=STEP_COLUMNS
    )
    buckets = pd.DataFrame(
        [
            {"rank": r, "step": s, "bucket": 0, "nbytes": 4 * MIB, "nparams": 1, "t_ready": 4.0}
            for s in range(4)
            for r in range(2)
        ],
        columns=BUCKET_COLUMNS,
    )
    base = steps.assign(step=steps["step"] + 10, t_step=4.0, paired_step=steps["step"]) if baseline else pd.DataFrame()
    return Run(
        path="fake-run",
        config=RunConfig(warmup=1, nproc=2, bucket_mb=25.0),
        resolved=dict(RESOLVED, **(resolved or {})),
        status={},
        steps=steps,
        baseline_steps=base,
        buckets=buckets,
        collectives=pd.DataFrame(),
        memory=pd.DataFrame(),
        ranks=pd.DataFrame({"rank": [0, 1], "host": ["vm", "vm"]}),
    )


def test_the_run_what_if_at_its_own_setting_uses_everything_it_measured():
    run, prof = fake_run(), hand_profile(alpha=20e-6, beta=1e-9)
    got = run.whatif(prof)
    assert isinstance(got, dtlab.WhatIf) and dtlab.whatif(run, prof).t_step == got.t_step  # one implementation
    assert got.setting == {"bucket_mb": 25.0, "nproc": 2, "nodes": 1, "ranks": 2, "ratio": 1.0, "here": True}
    used = "\n".join(got.used)
    for what in ("compute: forward 1000 ms", "no-op comm hook baseline", "bucket readiness", "cores: 2 ranks shared 2"):
        assert what in used, what
    assert "measured wait" in used and "link: all_reduce ring fit" in used
    # at the run's own cap the wait closes the gap to its paired exposed time (slowest 4.6 s - no-op 4.0 s): the
    # prediction's exposed communication is the run's own, on top of the baseline compute (1 + 3 + 0.5 s)
    assert got.exposed == pytest.approx(0.6, rel=1e-6) and got.t_comp == pytest.approx(4.5)
    assert got.exposed == pytest.approx(got.t_step - got.t_comp) and got.t_comm > 0
    # the fit's interval pushed through the step brackets it
    assert got.lo["t_step"] <= got.t_step <= got.hi["t_step"] and "fitted intervals" in got.band
    assert list(got.table()["quantity"]) == ["T_step", "T_comp", "T_comm", "exposed"] and set(got.table()["unit"]) == {
        "s"
    }
    assert "T_step" in str(got) and "used: compute" in str(got)


def test_more_ranks_on_the_same_cores_scale_compute_and_the_inputs_say_so():
    run, prof = fake_run(), hand_profile()
    two, three = run.whatif(prof), run.whatif(prof, nproc=3)
    assert three.t_comp == pytest.approx(1.5 * two.t_comp)  # 3 ranks on 2 cores: 1.5x the compute of 2
    assert "at 3 rank(s)" in "\n".join(three.used)


def test_a_profile_from_elsewhere_prices_the_link_but_not_the_runs_cores_or_wait():
    run = fake_run()
    box = hand_profile(alpha=8e-6, beta=1 / 300e9, nproc=8, host="dgx", backend="nccl")
    got = run.whatif(box, nproc=8)
    not_used = "\n".join(got.not_used)
    assert "measured wait: it belongs to the run's own transport" in not_used and "host 'dgx', nccl" in not_used
    assert "shared CPU cores" in not_used
    assert got.t_comp == pytest.approx(4.5)  # a device per rank: compute independent of the rank count
    # the same with here=True: the run's cores (8 ranks on 2 cores: 4x) and its wait come back
    here = run.whatif(box, nproc=8, here=True)
    assert here.t_comp == pytest.approx(4 * 4.5) and "measured wait" in "\n".join(here.used)


def test_a_run_without_baseline_steps_says_its_compute_is_estimated():
    got = fake_run(baseline=False).whatif(hand_profile())
    assert any("no-op hook baseline steps: fake-run has none" in n for n in got.not_used)
    assert "estimated" in got.used[0]
    assert any(n.startswith("measured wait: 0 ms (none") for n in got.not_used)


def test_a_link_by_hand_has_no_band_and_states_what_it_did_not_measure():
    got = fake_run().whatif(Link(alpha=20e-6, beta=1e-9))
    assert got.lo == {} and got.band.startswith("none") and math.isnan(got.table()["lo"].iloc[0])
    assert any("a Link says nothing of where it was measured" in n for n in got.not_used)
    assert any("stretch: none" not in u for u in got.used)


def test_the_link_of_a_loaded_calibration_stretches_backward():
    stretch = {"per_second": 0.5, "lo": 0.4, "hi": 0.6, "passes": 8, "idle_passes": 4}
    run = fake_run()
    plain = run.whatif(Link(alpha=20e-6, beta=1e-9), bucket_mb=1.0)
    got = run.whatif(Link(alpha=20e-6, beta=1e-9, stretch=0.5), bucket_mb=1.0)
    assert got.detail["stretch_s"] > 0 and got.t_comp > plain.t_comp
    prof = hand_profile(meta={"load": {"stretch": stretch}})
    assert any("stretch: measured" in u for u in run.whatif(prof).used)


def test_a_two_level_link_prices_two_nodes_of_real_gpus_from_a_hand_made_profile():
    """A real system's link in (here a hand-made one): 8 ranks a node on NVLink-like figures, 2 nodes over an
    InfiniBand-like network; the run's compute on a device of its own per rank."""
    run = fake_run()
    nvlink = hand_profile(alpha=8e-6, beta=1 / 300e9, nproc=8, host="box", backend="nccl")
    ib = hand_profile(alpha=25e-6, beta=1 / 25e9, nproc=2, host="box2", backend="nccl")
    two = TwoLevelLink.from_profiles(nvlink, ib, gpus_per_node=8)
    one = run.whatif(two, nproc=8, nodes=1)
    both = run.whatif(two, nproc=8, nodes=2)
    assert both.setting["ranks"] == 16 and both.t_comm > one.t_comm  # the network is the slow level
    sizes = list(reversed(RESOLVED["param_nbytes"]))
    by_hand = wi.whatif(1.0, 3.0, 0.5, sizes, 25.0, 16, two, ready_curve=both.detail and None)
    assert both.detail["durations"] == pytest.approx(by_hand["durations"])  # the bucket priced by the hierarchy
    assert both.lo["t_comm"] <= both.t_comm <= both.hi["t_comm"]
    assert "inside a node" in "\n".join(both.used)
    with pytest.raises(ValueError, match="nproc must equal the two-level link's gpus_per_node"):
        run.whatif(two, nproc=4, nodes=2)
    # one level across nodes is priced, and the inputs say it has no second level
    flat = run.whatif(Link.from_profile(nvlink), nproc=8, nodes=2)
    assert any("a second level" in n for n in flat.not_used)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(bucket_mb=0), "bucket_mb"),
        (dict(bucket_mb="25"), "bucket_mb"),
        (dict(nproc=0), "nproc"),
        (dict(nproc=2.5), "nproc"),
        (dict(nodes=0), "nodes"),
        (dict(compression=1.5), "compression"),
        (dict(compression=0), "compression"),
    ],
)
def test_bad_settings_are_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        fake_run().whatif(hand_profile(), **kw)


def test_compression_scales_the_wire_and_a_non_ddp_run_is_refused():
    run = fake_run()
    full, half = run.whatif(Link(alpha=0.0, beta=1e-9)), run.whatif(Link(alpha=0.0, beta=1e-9), compression=0.5)
    assert half.detail["durations"] == pytest.approx(full.detail["durations"] / 2) and half.setting["ratio"] == 0.5
    assert any("encode time: the run did not compress" in n for n in half.not_used)
    with pytest.raises(ValueError, match="link must be"):
        run.whatif("a profile")
    run.config = RunConfig(warmup=1, nproc=2, strategy="zero3")
    with pytest.raises(ValueError, match="^run: the what-if models DDP"):
        run.whatif(hand_profile())


def test_cost_prices_gpu_counts_through_the_runs_what_if_with_the_links_stretch():
    run = fake_run(resolved={"data_source": "generated by dtlab"})
    run.status = {"state": "done"}
    link = Link(alpha=20e-6, beta=1e-9, stretch=0.5, alpha_ci=(10e-6, 30e-6), beta_ci=(0.9e-9, 1.1e-9))
    c = dtlab.cost(run, profile=link, gpu_counts=(1, 2, 4))
    s = c.scaling.set_index("gpus")
    for p in (1, 2, 4):
        assert s.loc[p, "t_step_s"] == pytest.approx(run.whatif(link, nproc=p, nodes=1, here=False).t_step)
    assert s.loc[4, "t_step_lo_s"] <= s.loc[4, "t_step_s"] <= s.loc[4, "t_step_hi_s"]
    assert any("stretch 0.5 s per s in flight" in n for n in c.notes)


def test_the_runs_paired_steps_bound_what_the_calibrations_sharing_figures_add():
    # four 1 MiB buckets at a 1 MiB cap, ready along backward, 0.2 s each (ring, p = 2: n beta): three are in
    # flight during backward. A stretch of 2 s per s in flight would add more exposed time than the 0.6 s the
    # run's paired steps measured (4.6 - 4.0 s), so it is scaled down until the what-if reproduces those 0.6 s.
    run = fake_run(resolved={"param_nbytes": [MIB] * 4})
    run.config = RunConfig(warmup=1, nproc=2, bucket_mb=1.0)
    link = Link(alpha=0.0, beta=0.2 / MIB, stretch=2.0, contention=1.5)
    got = run.whatif(link, here=True)
    bounded = [u for u in got.used if u.startswith("sharing bounded by the run")]
    assert bounded and "scaled to contention" in bounded[0]
    assert 0 < got.detail["link"].stretch < 2.0 and 1 < got.detail["contention"] < 1.5
    assert got.exposed + got.detail["stretch_s"] == pytest.approx(0.6, rel=1e-6)
    # a link whose figures stay below what the run measured is used as it is, the rest is the run's wait
    mild = run.whatif(Link(alpha=0.0, beta=0.01 / MIB, stretch=0.1), here=True)
    assert not any(u.startswith("sharing bounded") for u in mild.used) and mild.detail["link"].stretch == 0.1


def test_cost_prices_whole_nodes_on_a_two_level_link():
    run = fake_run(resolved={"data_source": "generated by dtlab"})
    run.status = {"state": "done"}
    nvlink = hand_profile(alpha=8e-6, beta=1 / 300e9, nproc=8, host="box", backend="nccl")
    ib = hand_profile(alpha=25e-6, beta=1 / 25e9, nproc=2, host="box2", backend="nccl")
    two = TwoLevelLink.from_profiles(nvlink, ib, gpus_per_node=8)
    s = dtlab.cost(run, profile=two, gpu_counts=(1, 8, 16, 32)).scaling.set_index("gpus")
    assert s.loc[16, "t_step_s"] == pytest.approx(run.whatif(two, nproc=16, nodes=1, here=False).t_step)
    # the network level makes 16 GPUs (2 nodes) slower per step than 8 (one node), 32 slower still
    assert s.loc[8, "t_step_s"] < s.loc[16, "t_step_s"] < s.loc[32, "t_step_s"]
    assert (s["t_step_lo_s"] <= s["t_step_s"]).all() and (s["t_step_s"] <= s["t_step_hi_s"]).all()
    with pytest.raises(ValueError, match="nproc must fill whole nodes"):
        dtlab.cost(run, profile=two, gpu_counts=(12,))


def test_whatif_table_is_the_runs_whatif_at_each_setting():
    from dtlab.lab import whatif_table

    run, prof = fake_run(), hand_profile()
    df = whatif_table(run, prof, [(2, 25.0), (3, 1.0)])
    assert list(df["label"]) == ["p=2, 25 MiB", "p=3, 1 MiB"]
    for row in df.itertuples():
        w = run.whatif(prof, nproc=row.nproc, bucket_mb=row.bucket_mb)
        assert (row.t_step, row.t_comp, row.exposed) == (w.t_step, w.t_comp, w.exposed)
        assert row.t_step_lo <= row.t_step <= row.t_step_hi
    assert any(u.startswith("compute:") for u in df.attrs["used"]) and "fitted intervals" in df.attrs["band"]


def test_a_run_priced_on_a_shipped_8_gpu_box_and_two_such_nodes():
    """The lab's path: the run's compute, one 8-GPU NVSwitch box's all-reduce (a shipped nccl-tests output), then
    two such nodes over the network (the shipped 2-node output), each fitted over DDP's bucket sizes."""
    sizes = dict(min_bytes=4 * MIB, max_bytes=128 * MIB)
    box = dtlab.public_nccl_tests("aws-p5-1x8-h100-nvswitch", **sizes)
    pair = dtlab.public_nccl_tests("aws-p5-2x8-h100-efa", **sizes)
    link = TwoLevelLink.from_node_counts(box, pair)
    assert link.gpus_per_node == 8 and link.algorithm == "flat"
    # at the rank count the 2-node output timed, the link gives that output's own fit back
    assert link.time("all_reduce", 25 * MIB, 16) == pytest.approx(
        Link.from_profile(pair).time("all_reduce", 25 * MIB, 16)
    )
    assert link.time("all_reduce", 25 * MIB, 8) == pytest.approx(Link.from_profile(box).time("all_reduce", 25 * MIB, 8))
    run = fake_run()
    one = run.whatif(link, nproc=8, nodes=1, bucket_mb=25.0)
    two = run.whatif(link, nproc=8, nodes=2, bucket_mb=25.0)
    assert (one.setting["ranks"], two.setting["ranks"]) == (8, 16)
    assert two.t_comm > one.t_comm > 0  # the network is the slower level
    assert two.t_comp == pytest.approx(one.t_comp)  # a device per rank: compute does not change with the count
    for w in (one, two):
        assert w.lo["t_comm"] <= w.t_comm <= w.hi["t_comm"]  # both outputs' fits have intervals: a band
        # a public output is another system's collectives timed alone: said once, as what it is, not as missing
        used, not_used = "\n".join(w.used), "\n".join(w.not_used)
        assert "the link is another system's" in used and "a public nccl-tests output" in used
        assert "shared CPU cores" not in not_used and "measured wait" not in not_used and not w.setting["here"]
        assert "contention: none in an nccl-tests output" in used and "no loaded calibration" not in used
    text = "\n".join(two.used)
    assert "aws-p5-2x8-h100-efa (nccl-tests output, https://github.com/aws-samples/" in text
    assert "4,194,304..134,217,728 B" in text  # the sizes the fit saw
    with pytest.raises(ValueError, match="one_node must be timed on one node"):
        TwoLevelLink.from_node_counts(pair, box)
    with pytest.raises(ValueError, match="nodes must be timed on 2 or more nodes of 4 ranks"):
        TwoLevelLink.from_node_counts(dtlab.public_nccl_tests("sheffield-a100-sxm4-1x4"), pair)


def test_the_explorer_given_a_run_shows_the_runs_own_whatif():
    """The explorer does not assemble the step from parts: at every setting its figures are run.whatif's, with the
    run's cores and measured wait where the profile was calibrated on the run's machine (here: host vm, gloo)."""
    from dtlab.viz.dashboard import explorer

    run, prof = fake_run(), hand_profile(alpha=20e-6, beta=1e-9)
    ex = explorer(profile=prof, run=run)
    p = ex.params()
    want = run.whatif(prof, nproc=p["nproc"], bucket_mb=p["bucket_mb"], nodes=1, compression=1.0)
    assert want.setting["here"] and ex.state.run.here
    assert ex.result["t_step"] == pytest.approx(want.t_step, rel=1e-12) and ex.result["wait"] == want.detail["wait"]
    row = ex.sweep.set_index("label").loc[wi.config_label(p["nproc"], p["bucket_mb"])]
    assert row["t_step"] == pytest.approx(want.t_step, rel=1e-12)
    assert "no-op comm hook baseline of fake-run" in ex.children[0].value  # the run's compute, named
    # a moved slider: a Link of the values shown, still priced through the run's what-if (cores and wait included)
    ex.sliders["nproc"].value, ex.sliders["bandwidth_gbs"].value = 4, 0.05
    p = ex.params()
    link = Link(alpha=p["alpha"], beta=p["beta"], form=p["form"], contention=p["contention"])
    moved = run.whatif(link, nproc=4, bucket_mb=p["bucket_mb"], nodes=1, compression=1.0, here=True)
    fitted = run.whatif(prof, nproc=4, bucket_mb=p["bucket_mb"], nodes=1, compression=1.0)
    assert ex.result["t_step"] == pytest.approx(moved.t_step, rel=1e-12) and moved.t_step > fitted.t_step
    with pytest.raises(ValueError, match=r"^compute: come from the run"):
        explorer(profile=prof, run=run, compute={"t_fwd": 0.1, "t_bwd_comp": 0.2, "t_opt": 0.01})
