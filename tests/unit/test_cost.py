"""What training costs: the price table, cost across GPU counts, spot instances with checkpoints (Daly's exact
expected time beside Young's first order), and the cost of real recorded runs. Every expected figure below was
worked out by hand first; the arithmetic is in the comments."""

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

import dtlab
from dtlab.config.strategies import strategy_spec
from dtlab.model.cost import GpuPrice, PriceTable, example_prices
from dtlab.model.cost import scaling as cost_scaling
from dtlab.model.link import Link
from dtlab.model.restarts import daly_interval, young_interval
from dtlab.model.spot import expected_time, first_order_time, optimal_interval, spot_plan
from dtlab.model.whatif import whatif
from dtlab.results.cost import cost, epoch_samples, samples_per_step

FIXTURE_DDP = "tests/fixtures/run-v1-ddp"


def fit(alpha=0.0, beta=0.0, alpha_ci=(0.0, 0.0), beta_ci=(0.0, 0.0)) -> Link:
    return Link(alpha=alpha, beta=beta, alpha_ci=alpha_ci, beta_ci=beta_ci, source="a fit by hand")


def scaling(compute, sizes, cap, link, counts, per_gpu, samples, price):
    """dtlab.model.cost.scaling of the pure what-if step on `link` (the step dtlab.cost passes is the run's)."""

    def step_s(p, lk):
        return whatif(compute["t_fwd"], compute["t_bwd_comp"], compute["t_opt"], sizes, cap, p, lk)["t_step"]

    return cost_scaling(step_s, link, counts, per_gpu, samples, price)


COMPUTE = {"t_fwd": 0.3, "t_bwd_comp": 0.6, "t_opt": 0.1}  # 1.0 s of compute per step and rank


# ------------------------------------------------------------------ the price table


def test_the_example_table_is_the_courses_figure_and_says_so():
    p = example_prices()
    assert p.kinds() == ["H100", "H200", "A100", "CPU"]
    for row in p.rows:
        assert (row.on_demand, row.spot) == (2.0, 1.0)  # "8 GPUs x $2/hour"; spot "about 50 % cheaper"
        assert row.example and "example" in row.source and "$2/hour" in row.source
        assert row.date == "2026-11-27"
        assert row.discount == pytest.approx(0.5)
    f = p.frame()
    assert list(f.columns[:4]) == ["kind", "on_demand_usd_per_gpu_hour", "spot_usd_per_gpu_hour", "spot_discount"]
    assert p.price("CPU").unit == "USD per machine-hour" and p.price("h100").unit == "USD per GPU-hour"


def test_the_user_sets_a_price_by_spot_or_by_discount():
    p = example_prices().with_price("H100", on_demand=4.0, discount=0.7, source="my quote", date="2026-11-01")
    h = p.price("H100")
    assert (h.on_demand, h.spot) == (4.0, pytest.approx(1.2))  # 4.00 x (1 - 0.7) = 1.20
    assert not h.example and h.source == "my quote"
    assert p.kinds().count("H100") == 1 and len(p.rows) == 4  # replaced, not added
    p = p.with_price("L4", on_demand=0.8, spot=0.3)
    assert p.price("l4").spot == 0.3 and len(p.rows) == 5
    own = PriceTable.from_frame(pd.DataFrame({"kind": ["H100"], "on_demand": [3.0], "spot": [1.5]}), date="2026-10-01")
    assert own.price("H100").on_demand == 3.0 and own.price("H100").date == "2026-10-01"


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: GpuPrice(kind="H100", on_demand=-1.0, spot=0.5), "prices['H100'].on_demand"),
        (lambda: GpuPrice(kind="H100", on_demand=2.0, spot=-0.1), "prices['H100'].spot"),
        (lambda: GpuPrice(kind="H100", on_demand=2.0, spot=float("nan")), "prices['H100'].spot"),
        (lambda: GpuPrice(kind="H100", on_demand=1.0, spot=2.0), "at most its on_demand"),
        (lambda: GpuPrice(kind="", on_demand=1.0, spot=0.5), "kind"),
        (lambda: GpuPrice(kind="H100", on_demand=1.0, spot=0.5, date="last week"), "prices['H100'].date"),
        (lambda: example_prices().price("L4"), "gpu 'L4' is not in the price table: kinds are 'H100'"),
        (lambda: example_prices().with_price("H100", 2.0, discount=1.0), "discount"),
        (lambda: example_prices().with_price("H100", 2.0, discount=-0.1), "discount"),
        (lambda: example_prices().with_price("H100", 2.0, spot=1.0, discount=0.5), "exactly one of spot"),
        (lambda: PriceTable(example_prices().rows + example_prices().rows[:1]), "each kind must appear once"),
        (lambda: PriceTable.from_frame(pd.DataFrame({"kind": ["H100"], "on_demand": [1.0]})), "missing ['spot']"),
    ],
)
def test_a_bad_price_is_refused_by_name(make, field):
    with pytest.raises(ValueError) as e:
        make()
    assert field in str(e.value)


# ------------------------------------------------------------------ across GPU counts


def test_the_courses_example_8_gpus_at_2_dollars_for_100_hours():
    # no communication (alpha = beta = 0): a step is 0.3 + 0.6 + 0.1 = 1.0 s at every GPU count. 8 GPUs x 10 samples a
    # step = 80 samples a step; 28,800,000 samples = 360,000 steps = 360,000 s = 100 h. 8 GPUs x 100 h = 800
    # GPU-hours; x $2 = $1,600 on-demand, x $1 = $800 spot. One GPU: 2,880,000 steps = 800 h, the same 800 GPU-hours.
    df = scaling(COMPUTE, [2**20], 25, fit(), (8, 1, 4, 2), 10, 28_800_000, example_prices().price("H100"))
    assert list(df["gpus"]) == [1, 2, 4, 8]
    row = df.set_index("gpus").loc[8]
    assert row["steps"] == 360_000 and row["wall_s"] == pytest.approx(360_000)
    assert row["gpu_hours"] == pytest.approx(800) and row["on_demand_usd"] == pytest.approx(1600)
    assert row["spot_usd"] == pytest.approx(800)
    assert df["speedup"].tolist() == pytest.approx([1, 2, 4, 8]) and df["efficiency"].tolist() == pytest.approx([1] * 4)
    assert df.set_index("gpus").loc[1, "wall_s"] == pytest.approx(2_880_000)
    # equal cost everywhere: the first (fewest GPUs) is the cheapest, 8 GPUs the fastest
    assert df["cheapest"].tolist() == [True, False, False, False]
    assert df["fastest"].tolist() == [False, False, False, True]


def test_scaling_prices_the_ring_all_reduce_and_carries_the_fits_interval():
    # one 1 MiB bucket (1,048,576 B), ready when backward ends, so its all-reduce is all exposed. Ring, alpha 0,
    # beta 1e-9 s/B: 2 (p-1)/p x 1,048,576 x 1e-9 s. p = 2: 1.048576 ms -> t_step 1.001048576 s; p = 4: 1.5 x that =
    # 1.572864 ms; p = 8: 1.75 x = 1.835008 ms. The fit's beta interval [0.5e-9, 2e-9] halves and doubles it.
    f = fit(beta=1e-9, beta_ci=(0.5e-9, 2e-9))
    df = scaling(COMPUTE, [2**20], 25, f, (1, 2, 4, 8), 10, 80_000, example_prices().price("H100")).set_index("gpus")
    assert df.loc[1, "t_step_s"] == pytest.approx(1.0)
    assert df.loc[2, "t_step_s"] == pytest.approx(1.001048576, rel=1e-12)
    assert df.loc[4, "t_step_s"] == pytest.approx(1.001572864, rel=1e-12)
    assert df.loc[8, "t_step_s"] == pytest.approx(1.001835008, rel=1e-12)
    assert df.loc[8, "t_step_lo_s"] == pytest.approx(1.000917504, rel=1e-12)  # half the 1.835008 ms
    assert df.loc[8, "t_step_hi_s"] == pytest.approx(1.003670016, rel=1e-12)  # twice it
    # p = 8: speedup 8 x 1.0 / 1.001835008 = 7.98533; 80,000 samples = 1,000 steps = 1,001.835 s; 8 x that / 3600 =
    # 2.226300 GPU-hours = $4.452600 on-demand
    assert df.loc[8, "speedup"] == pytest.approx(7.98533, rel=1e-5)
    assert df.loc[8, "on_demand_usd"] == pytest.approx(4.452600, rel=1e-6)
    assert df.loc[8, "on_demand_usd_lo"] < df.loc[8, "on_demand_usd"] < df.loc[8, "on_demand_usd_hi"]
    # 80,000 samples divide evenly at every count: cost(p) / cost(1) = t_step(p) / t_step(1) = 1 / efficiency
    ratio = df["on_demand_usd"] / df.loc[1, "on_demand_usd"]
    assert ratio.tolist() == pytest.approx((1 / df["efficiency"]).tolist(), rel=1e-12)
    assert "intervals of alpha and beta" in df.attrs["band"]
    assert df["cheapest"].sum() == 1 and df.loc[1, "cheapest"] and df.loc[8, "fastest"]


def test_a_link_without_an_interval_gives_no_band_and_says_so():
    f = Link(alpha=0.0, beta=1e-9)
    df = scaling(COMPUTE, [2**20], 25, f, (1, 2), 10, 1000, example_prices().price("H100"))
    assert df[["t_step_lo_s", "t_step_hi_s", "on_demand_usd_lo", "spot_usd_hi"]].isna().all().all()
    assert df.attrs["band"].startswith("unknown")


@pytest.mark.parametrize(
    "counts, samples, field", [((0, 2), 100, "gpu_counts"), ((), 100, "gpu_counts"), ((1, 2), -5, "samples")]
)
def test_bad_scaling_inputs_are_refused_by_name(counts, samples, field):
    with pytest.raises(ValueError, match=field):
        scaling(COMPUTE, [2**20], 25, fit(), counts, 10, samples, example_prices().price("H100"))


# ------------------------------------------------------------------ spot instances and checkpoints


def test_dalys_expected_time_by_hand():
    # M = 3600 s, C = 60 s, R = 120 s, tau = 600 s, W = 36,000 s (10 h of work):
    # e^(R/M) = e^(1/30) = 1.0338951; e^((tau + C)/M) = e^(660/3600) = e^0.1833333 = 1.2012147
    # T = 3600 x 1.0338951 x 0.2012147 x (36,000 / 600 = 60) = 3600 x 0.2080349 x 60 = 44,935.5 s (12.48 h)
    assert expected_time(36_000, 600, 60, 120, 3600) == pytest.approx(44_935.5, rel=2e-6)
    # never interrupted (on-demand): T = W (tau + C) / tau = 36,000 x 660 / 600 = 39,600 s = 11 h
    assert expected_time(36_000, 600, 60, 120, math.inf) == pytest.approx(39_600)


def test_youngs_first_order_is_below_dalys_exact_time_and_closes_in_as_mtbi_grows():
    # first order: W (1 + C/tau + (tau/2 + R)/M) = 36,000 x (1 + 0.1 + 420/3600 = 0.1166667) = 43,800 s,
    # 2.6 % below the exact 44,935.5 s: the terms it drops (C/M, (tau/M)^2, ...) are not small at M = 1 h
    assert first_order_time(36_000, 600, 60, 120, 3600) == pytest.approx(43_800)
    exact, first = expected_time(36_000, 600, 60, 120, 3600), first_order_time(36_000, 600, 60, 120, 3600)
    assert 0.02 < exact / first - 1 < 0.03
    # M = 100 h, tau = 6573 s (Young's sqrt(2 x 60 x 360,000)): they agree within 0.03 %
    exact, first = expected_time(36_000, 6573, 60, 120, 360_000), first_order_time(36_000, 6573, 60, 120, 360_000)
    assert abs(exact / first - 1) < 3e-4


def test_the_optimal_interval_is_dalys_minimum():
    # sqrt(2 x 60 x 3600) = sqrt(432,000) = 657.3 s (Young); Daly's estimate: x = 60/7200 = 0.008333,
    # 657.27 x (1 + sqrt(x)/3 + x/9 = 1.031355) - 60 = 617.88 s. The exact optimum M (1 + W0(-e^-(1 + 1/60)))
    # solves e^((tau + C)/M) (1 - tau/M) = 1, at 617.89 s: a hair from Daly's estimate while C << M.
    tau = optimal_interval(60, 3600)
    assert young_interval(60, 3600) == pytest.approx(657.27, abs=0.01)
    assert tau == pytest.approx(daly_interval(60, 3600), rel=1e-4) and tau == pytest.approx(617.89, abs=0.01)
    assert math.exp((tau + 60) / 3600) * (1 - tau / 3600) == pytest.approx(1.0, abs=1e-12)
    grid = np.linspace(0.5 * tau, 2 * tau, 30_001)
    assert expected_time(36_000, tau, 60, 120, 3600) <= expected_time(36_000, grid, 60, 120, 3600).min() + 1e-9
    # C = 1 ms, M = 1e7 s (C/M = 1e-10, next to W0's branch point): Daly's series is exact to ~1e-12 there,
    # sqrt(2e4) = 141.4213562 x (1 + sqrt(5e-11)/3) - 0.001 = 141.4206896 s
    assert optimal_interval(1e-3, 1e7) == pytest.approx(141.4206896, rel=1e-9)
    assert optimal_interval(1e-3, 1e7) == pytest.approx(daly_interval(1e-3, 1e7), rel=1e-9)
    # C = M/2: Young's sqrt(2 x 1800 x 3600) = 3600 s is far off; Daly's estimate (2500 s) close to the exact 2514 s
    big = optimal_interval(1800, 3600)
    assert big == pytest.approx(2513.85, abs=0.01)
    assert abs(daly_interval(1800, 3600) - big) < 20 < abs(young_interval(1800, 3600) - big)


def test_spot_plan_beside_on_demand_by_hand():
    # 8 GPUs, on-demand $2 per GPU-hour, spot 50 % off = $1. At tau = 600 s: spot 44,935.5 s x 8 / 3600 x $1 =
    # $99.857; on-demand (never interrupted) 39,600 s = 11 h x 8 x $2 = $176. Expected interruptions: T / M = 12.48.
    plan = spot_plan(36_000, checkpoint_s=60, restart_s=120, mtbi_s=3600, gpus=8, intervals=[600, 36_000])
    row = plan.table.set_index("interval_s").loc[600]
    assert row["spot_usd"] == pytest.approx(99.857, rel=1e-4)
    assert row["on_demand_usd"] == pytest.approx(176.0) and row["on_demand_wall_s"] == pytest.approx(39_600)
    assert row["spot_interruptions"] == pytest.approx(12.482, rel=1e-4) and row["cheaper"] == "spot"
    assert row["checkpoints"] == 60 and row["first_order_wall_s"] == pytest.approx(43_800)
    # one checkpoint at the end on spot: 3600 e^(1/30) (e^(36,060/3600) - 1) = 83.4 million s; on-demand wins there
    assert plan.table.set_index("interval_s").loc[36_000, "cheaper"] == "on-demand"
    best = plan.best.set_index("choice")
    assert best.loc["spot, exact optimum", "interval_s"] == pytest.approx(617.89, abs=0.01)
    assert best.loc["spot, exact optimum", "usd"] <= best.loc["spot, Young's sqrt(2CM)", "usd"]
    # on-demand's best: no interruptions, so one checkpoint at the end: 36,060 s x 8 / 3600 x $2 = $160.27
    assert best.loc["on-demand, its best", "usd"] == pytest.approx(160.2667, rel=1e-6)
    assert "saves $60.4" in str(plan)  # 160.27 - 99.85 at the spot optimum
    same = spot_plan(36_000, checkpoint_s=60, restart_s=120, interruptions_per_hour=1.0, gpus=8, intervals=[600])
    assert same.table["spot_usd"].iat[0] == pytest.approx(row["spot_usd"])


def test_spot_plans_default_intervals_bracket_the_optimum():
    plan = spot_plan(36_000, checkpoint_s=60, restart_s=120, mtbi_s=3600)
    tau = optimal_interval(60, 3600)
    assert plan.table["interval_s"].min() < tau < plan.table["interval_s"].max() == 36_000
    assert plan.table["spot_usd"].min() == pytest.approx(plan.best["usd"].iat[0])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(discount=1.0), "discount"),
        (dict(discount=-0.2), "discount"),
        (dict(mtbi_s=0), "mtbi_s"),
        (dict(mtbi_s=None), "exactly one of mtbi_s"),
        (dict(interruptions_per_hour=2.0), "exactly one of mtbi_s"),
        (dict(checkpoint_s=-1), "checkpoint_s"),
        (dict(checkpoint_s=0), "checkpoint_s must be > 0"),
        (dict(restart_s=float("inf")), "restart_s"),
        (dict(gpus=0), "gpus"),
        (dict(on_demand_usd_per_gpu_hour=-2), "on_demand_usd_per_gpu_hour"),
        (dict(intervals=[600, 40_000]), "intervals"),
        (dict(work_s=0), "work_s"),
    ],
)
def test_bad_spot_inputs_are_refused_by_name(kwargs, field):
    args = dict(work_s=36_000, checkpoint_s=60, restart_s=120, mtbi_s=3600)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        spot_plan(args.pop("work_s"), **args)


# ------------------------------------------------------------------ a run's cost


def test_samples_per_step_counts_the_data_parallel_shares():
    def fake(strategy, nproc):
        cfg = dtlab.RunConfig(batch_size=4, accumulate=2, dp_degree=2)
        return SimpleNamespace(spec=strategy_spec(strategy), config=cfg, nproc=nproc, path="fake")

    assert samples_per_step(fake("ddp", 4))[0] == 32  # 4 x 2 x 4 ranks
    assert samples_per_step(fake("pp", 4))[0] == 16  # 4 x 2 x 2 replicas (dp_degree), not x 4 ranks
    assert samples_per_step(fake("tp", 4))[0] == 16
    assert samples_per_step(fake("async", 4))[0] == 24  # 4 x 2 x 3 workers (rank 0 serves)


def test_epoch_size_comes_from_the_data_source_or_is_said_unknown():
    def fake(src):
        return SimpleNamespace(resolved={"data_source": src})

    assert epoch_samples(fake("GLUE SST-2 train split (datasets)"))[0] == 67_349
    assert epoch_samples(fake("local file /data/x.csv (40 rows, cycled 1.6 times)"))[0] == 40
    size, how = epoch_samples(fake("somewhere else"))
    assert size is None and "dataset_size" in how
    assert epoch_samples(fake("somewhere else"), dataset_size=1000)[0] == 1000
    with pytest.raises(ValueError, match="dataset_size"):
        epoch_samples(fake("x"), dataset_size=0)


def test_a_recorded_h200_run_costs_finite_money_by_hand():
    rec = dtlab.recorded_run("h200-ddp")
    cal = dtlab.recorded_calibration("h200-calibration")
    c = dtlab.cost(rec, profile=cal.profile, target_accuracy=0.9)
    assert (c.gpu, c.gpus, c.samples_per_step) == ("H200", 1, 16)  # 2 ranks shared 1 H200; 8 per rank x 2 ranks
    t = rec.run.summary().set_index("quantity").loc["T_step", "value"]  # 0.122 s
    step = c.row("step")
    # 1 GPU x 0.122 s / 3600 = 3.39e-5 GPU-hours; x $2 = $6.78e-5
    assert step["gpu_hours"] == pytest.approx(t / 3600) and step["on_demand_usd"] == pytest.approx(2 * t / 3600)
    assert step["wall_lo_s"] <= step["wall_s"] <= step["wall_hi_s"]
    epoch = c.row("epoch")
    assert epoch["steps"] == 4210  # ceil(67,349 / 16 = 4209.3): the generated set stops at SST-2's size
    assert epoch["on_demand_usd"] == pytest.approx(4210 * 2 * t / 3600) and epoch["spot_usd"] == pytest.approx(
        4210 * t / 3600
    )
    assert math.isnan(c.row("to accuracy").wall_s) and "no held-out evaluations" in c.row("to accuracy").how
    s = c.scaling
    assert np.isfinite(s[["t_step_s", "speedup", "efficiency", "on_demand_usd", "spot_usd"]].to_numpy()).all()
    assert s["cheapest"].sum() == 1 and s["fastest"].sum() == 1
    assert s["t_step_lo_s"].isna().all() and s.attrs["band"].startswith("unknown")  # recorded fits carry no beta CI
    assert any("2 ranks sharing a GPU" in n for n in c.notes) and "example" in str(c)


def test_a_cpu_fixture_run_to_a_target_it_did_and_did_not_reach():
    run = dtlab.load_run(FIXTURE_DDP)
    c = cost(run, target_accuracy=0.9, gpus=8)
    assert c.gpu == "CPU" and c.gpus == 8 and c.scaling is None
    assert "not reached: best held-out accuracy 0.500" in c.row("to accuracy").how
    assert any("pass profile=" in n for n in c.notes)
    t = run.summary().set_index("quantity").loc["T_step", "value"]
    assert c.row("step")["gpu_hours"] == pytest.approx(8 * t / 3600)  # 8 devices billed, as given
    # priced as a GPU, a CPU run's bill says what it counted: the machine, at the GPU's price, not a GPU's speed
    h100 = cost(run, gpu="H100").notes[0]
    assert h100.startswith("billed: 1 CPU machine(s), one per node, each priced as one H100") and "CPU run's" in h100
    assert "priced as" not in cost(run).notes[0]
    eight = cost(run, gpu="H100", gpus=8).notes[0]  # the devices given: still a CPU run's step time, said so
    assert eight.startswith("billed: 8 device(s), as given, each priced as one H100")
    reached = cost(run, target_accuracy=0.5).row("to accuracy")
    assert reached["steps"] == 0 and reached["wall_s"] == 0.0  # the first evaluation, before any step, reads 0.5


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(gpu="L4"), "gpu 'L4' is not in the price table"),
        (dict(prices={"H100": 2.0}), "prices must be a PriceTable"),
        (dict(target_accuracy=1.5), "target_accuracy"),
        (dict(target_accuracy=0), "target_accuracy"),
        (dict(gpus=0), "gpus"),
    ],
)
def test_bad_cost_inputs_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        cost(dtlab.load_run(FIXTURE_DDP), **kwargs)


def test_a_price_table_without_the_runs_kind_names_gpu():
    table = PriceTable((GpuPrice(kind="H100", on_demand=2.0, spot=1.0),))
    with pytest.raises(ValueError, match="gpu 'CPU' is not in the price table"):
        cost(dtlab.load_run(FIXTURE_DDP), prices=table)
    assert cost(dtlab.load_run(FIXTURE_DDP), prices=table, gpu="H100").price.on_demand == 2.0
