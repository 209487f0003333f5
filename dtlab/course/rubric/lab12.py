"""Lab 12 (what does it cost?): GPU-hours and USD of one epoch from a run's T_step, the cheapest and the fastest GPU
count to the target accuracy from the what-if model, the best checkpoint interval for spot instances from a
measured checkpoint cost, and the all-reduce time of the run's buckets on a real system's link (two AWS p5 nodes,
from their public nccl-tests outputs)."""

from __future__ import annotations

import math
import os

import numpy as np

from dtlab.course.checks import tol_from_spread
from dtlab.course.rubric import Question, graded_run, t_step_spread
from dtlab.course.verdicts import MAX_REL_TOL, Key
from dtlab.model.cost import example_prices
from dtlab.model.link import TwoLevelLink
from dtlab.model.restarts import measured_costs
from dtlab.model.spot import optimal_interval
from dtlab.results.cost import billed_devices, cost, epoch_samples, hours_unit, samples_per_step
from dtlab.results.nccl_profile import public_nccl_tests
from dtlab.results.whatif import whatif

LAB = "12_what_does_it_cost"
TARGET = 0.9  # held-out accuracy
GPU_COUNTS = (1, 2, 4, 8)
MTBI_S = 3600.0  # spot: one interruption an hour on average, the rate question 5 assumes
#: the priced run: lab 9's baseline (quick mode: the tiny model reaches the target; full mode: about one epoch)
FIELDS = {
    True: dict(steps=90, warmup=2, baseline_steps=2, batch_size=32, lr=3e-3, eval_every=5),
    False: dict(steps=1000, warmup=5, baseline_steps=3, lr=5e-5, eval_every=100),
}
#: the run that measures C and R: checkpoints every 2 steps, rank 1 killed at the start of step 3 (DTLAB_FAULT)
CRASH = dict(steps=8, baseline_steps=0, checkpoint_every=2, max_restarts=1)
FAULT = "1:3:kill"


def sizes(quick: bool) -> list[int]:
    return [2**k for k in range(14, 23 if quick else 27, 2)]


def calib_fields(quick: bool, nproc: int) -> dict:
    return {"nproc": nproc, "ops": ["all_reduce"], "sizes": sizes(quick), "iters": 4 if quick else 10}


def sources(rec) -> dict:
    """The priced run (held-out evaluations), the all-reduce calibration and the crashed run."""
    cfg = rec.lab_config(**FIELDS[rec.quick])
    return {
        "run": lambda: rec.run(cfg, "lab 12's priced run (eval_every)"),
        "profile": lambda: rec.calibration(calib_fields(rec.quick, cfg.nproc), "lab 12's all-reduce calibration"),
        "crashed": lambda: rec.run(
            rec.lab_config(**CRASH), "lab 12's crashed and resumed run (checkpoint_every=2, max_restarts=1)"
        ),
    }


#: the rounding of T_step as the lab prints it (3 significant digits: at most 0.5% of a value from 100 to 999)
ROUNDING = 0.005


def _epoch(run):
    return cost(run, example_prices()).row("epoch")


def variables(run) -> dict:
    """The bill's inputs by name, as the lab prints them (`bill_inputs`): an answer may be an expression of these
    (t_step_s, samples_per_step, epoch_samples, devices, price), so a re-run recomputes it from its own run."""
    t = run.summary().set_index("quantity").loc["T_step"]
    return {
        "t_step_s": float(t["value"]),
        "samples_per_step": samples_per_step(run)[0],
        "epoch_samples": epoch_samples(run)[0],
        "devices": billed_devices(run)[0],
        "price": cost(run, example_prices()).price.on_demand,
    }


def _t_step_tol(run) -> tuple[float, str]:
    rel, words = t_step_spread(run)
    return max(rel, ROUNDING), f"{words}, at least {ROUNDING:.1%} for T_step rounded to 3 digits"


def _gpu_hours(run) -> Key:
    row = _epoch(run)
    rel, words = _t_step_tol(run)
    return Key(
        "lab12.q1",
        "number",
        float(row["gpu_hours"]),
        points=2,
        rel_tol=rel,
        unit=hours_unit(run),
        tol_source=f"the epoch's steps x this run's median T_step x devices billed; {words}",
        env=variables(run),
        graded_on=graded_run(run, "the priced run"),
        hint="steps per epoch = ceil(epoch samples / samples per step); x T_step (s) x devices billed / 3600",
        ratio_hints={
            3600.0: "that is device-seconds: divide by 3600 for hours",
            3.6e6: "T_step is in seconds in the formula: you used milliseconds, and seconds for hours",
            1e3: "T_step is in seconds: you multiplied by milliseconds",
        },
    )


def _usd(run) -> Key:
    row = _epoch(run)
    rel, words = _t_step_tol(run)
    return Key(
        "lab12.q2",
        "number",
        float(row["on_demand_usd"]),
        rel_tol=rel,
        unit="USD",
        tol_source=f"device-hours per epoch x the example on-demand price; {words}",
        env=variables(run),
        graded_on=graded_run(run, "the priced run"),
        hint="device-hours x the on-demand price per device-hour",
        ratio_hints={0.5: "that is the spot price: the question asks for on-demand"},
    )


def priced(run, profile):
    """dtlab.cost of the run to the target accuracy across GPU_COUNTS with the profile: the samples to the target
    (its steps to the target x samples per step), or one epoch when the run never reached it."""
    steps = run.steps_to(TARGET)
    samples = None if steps is None else steps * samples_per_step(run)[0]
    return cost(run, example_prices(), target_accuracy=TARGET, profile=profile, gpu_counts=GPU_COUNTS, samples=samples)


def _within_band(scaling, col: str) -> list[int]:
    """The counts the model's band cannot tell from the best by `col` (wall_s, gpu_hours): every count whose lower
    end is not above the best count's upper end; the best alone when the band is unknown."""
    best = scaling.loc[scaling[col].idxmin()]
    lo, hi = "t_step_lo_s", "t_step_hi_s"
    if scaling[[lo, hi]].isna().any().any():
        return [int(best["gpus"])]
    per = {"wall_s": scaling["steps"], "gpu_hours": scaling["steps"] * scaling["gpus"]}[col]
    lows, best_hi = per * scaling[lo], float(per[best.name] * scaling.loc[best.name, hi])
    return [int(g) for g, v in zip(scaling["gpus"], lows) if v <= best_hi]


def _choice(qid: str, run, profile, col: str, what: str) -> Key:
    sc = priced(run, profile).scaling
    if sc is None:
        raise ValueError("the run cannot be priced across GPU counts (see dtlab.cost's notes)")
    right = _within_band(sc, col)
    best = sc.loc[sc[col].idxmin()]
    return Key(
        qid,
        "choice",
        right,
        choices=GPU_COUNTS,
        tol_source="the what-if model's table from this lab's calibration and run; every count the fit's band "
        "cannot tell from the best counts as right (only the best when the band is unknown)",
        explanation=f"{what}: {int(best['gpus'])} GPU(s) ({col} {best[col]:.4g}); within the band: {right}",
        graded_on=graded_run(run, "the priced run") + " and this lab's all-reduce calibration",
        hint="cost(p) / cost(1) = steps(p) p t_step(p) / (steps(1) t_step(1)): about t_step(p) / t_step(1) with a "
        "price per GPU-hour"
        if col == "gpu_hours"
        else "wall time = steps(p) x t_step(p): more GPUs take fewer steps, each longer by its all-reduce",
    )


def _cheapest(run, profile) -> Key:
    return _choice("lab12.q3", run, profile, "gpu_hours", "cheapest")


def _fastest(run, profile) -> Key:
    return _choice("lab12.q4", run, profile, "wall_s", "fastest")


def save_times(crashed) -> list[float]:
    """The slowest rank's save time (s) of every checkpoint of the crashed run."""
    ck = crashed.checkpoints
    return [float(t) for t in ck.groupby(["attempt", "step"])["t_save"].max()] if not ck.empty else []


def _interval(crashed) -> Key:
    saves = save_times(crashed)
    if not saves:
        raise ValueError("the crashed run saved no checkpoint: no checkpoint cost to plan with")
    c = measured_costs(crashed)["checkpoint_s"]  # the median of the saves above
    spread = [optimal_interval(s, MTBI_S) for s in saves]
    return Key(
        "lab12.q5",
        "number",
        optimal_interval(c, MTBI_S),
        points=2,
        rel_tol=max(0.05, tol_from_spread(spread)),
        unit="s",
        tol_source="the optimum at each checkpoint's own save time: half their range over the median, at least 5% "
        "(Young's sqrt(2CM) is within it)",
        env={"C": c, "M": MTBI_S},
        graded_on=f"the crashed run {os.path.basename(str(crashed.path).rstrip('/'))} (C {c:.3g} s, the median of "
        f"{len(saves)} saves)",
        hint=f"Young: sqrt(2 C M) with C the median save time (s) and M = {MTBI_S:g} s",
        ratio_hints={1 / math.sqrt(2.0): "sqrt(2 C M), not sqrt(C M)", 1 / 60.0: "the question asks for seconds"},
    )


#: Section 5's real system: one AWS p5 box (8 H100 on NVSwitch) and two such boxes over EFA (public nccl-tests
#: outputs shipped with dtlab, each fitted over all its sizes, piecewise), and the nodes question 6 prices.
REAL_BOX, REAL_PAIR, REAL_NODES = "aws-p5-1x8-h100-nvswitch", "aws-p5-2x8-h100-efa", 2
#: Question 6's answer is computed from the table's alpha and 1/beta, printed to 3 significant digits: each at most
#: 0.5% off, so a sum of their terms at most about 1%.
PRINTED = 0.01


def real_link() -> TwoLevelLink:
    """The link section 5 builds: TwoLevelLink.from_node_counts of the two public p5 outputs."""
    return TwoLevelLink.from_node_counts(public_nccl_tests(REAL_BOX), public_nccl_tests(REAL_PAIR))


def real_allreduce_s(run, link: TwoLevelLink, nodes: int) -> tuple[float, float, float]:
    """(seconds, low, high): the all-reduces of one step's DDP buckets (the run's own layout at its cap, from
    run.whatif, each its bytes on the wire) on `link` at `nodes` nodes of link.gpus_per_node ranks, summed: the
    time the link spends all-reducing per step. The band: the same sum at the ends of the link's fitted intervals
    (NaN without)."""
    w = whatif(run, link, nproc=link.gpus_per_node, nodes=nodes)
    sizes = w.setting["ratio"] * np.asarray(w.detail["bucket_nbytes"], dtype=float)
    p = nodes * link.gpus_per_node

    def total(lk):
        return float(np.sum(lk.time("all_reduce", sizes, p)))

    ends = link.bounds()
    lo, hi = (math.nan, math.nan) if ends is None else sorted((total(ends[0]), total(ends[1])))
    return total(link), lo, hi


def _real(run) -> Key:
    t, lo, hi = real_allreduce_s(run, real_link(), REAL_NODES)
    band = max(hi - t, t - lo) / t if t > 0 and math.isfinite(lo) else 0.0
    return Key(
        "lab12.q6",
        "number",
        t * 1e6,
        points=2,
        rel_tol=min(MAX_REL_TOL, max(band, PRINTED)),
        unit="us",
        tol_source="the band of the p5 outputs' fits (their 95% intervals of alpha and beta pushed through the same "
        f"sum), at least {PRINTED:.0%} for alpha and 1/beta printed to 3 digits",
        graded_on=graded_run(run, "the priced run")
        + f"'s buckets, on the public nccl-tests outputs {REAL_BOX} and {REAL_PAIR}",
        hint="per bucket of n bytes on p = 16 ranks: 2(p-1) max(intra alpha + n/p intra beta, inter alpha + n/p "
        "inter beta), with beta = 1 / bandwidth and each bucket's own regime; summed over the buckets",
        ratio_hints={
            1e-6: "that is seconds: the question asks for microseconds",
            1e-3: "that is milliseconds: the question asks for microseconds",
            0.5: "a ring all-reduce takes 2(p-1) steps: a reduce-scatter, then an all-gather",
        },
    )


def _this_machines_alpha(profile) -> list[float]:
    """What section 2 prints of this machine's calibration, in microseconds: its all-reduce alpha. The key of
    question 6 is priced on the public p5 outputs, not on this machine, so that alpha is no reading of it."""
    return [1e6 * float(profile.fits["all_reduce"].alpha)]


QUESTIONS = (
    Question("lab12.q1", 2, "my_gpu_hours_per_epoch", ("run",), _gpu_hours),
    Question("lab12.q2", 1, "my_usd_per_epoch", ("run",), _usd),
    Question("lab12.q3", 1, "my_cheapest_gpus", ("run", "profile"), _cheapest),
    Question("lab12.q4", 1, "my_fastest_gpus", ("run", "profile"), _fastest),
    Question("lab12.q5", 2, "my_best_interval_s", ("crashed",), _interval),
    Question("lab12.q6", 2, "my_allreduce_us_two_nodes", ("run",), _real, _this_machines_alpha, ("profile",)),
)
