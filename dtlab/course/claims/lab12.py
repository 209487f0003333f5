"""What lab 12 (what does it cost?) prints beside dtlab.cost and dtlab.spot_plan: what a bill is made of, a run
interrupted at random moments, what each interruption cost, and the claim that the spot model prices it.

Interruptions at random moments (`interrupted_run`, `count_line`) live in dtlab.launching.interrupts.

What one interruption costs (`interruption_costs`, from the run's records alone): the wall time from the moment the
state the group resumed from was reached (the end of that checkpoint's save, the restart that loaded it, or the start
of training) to the moment the group had loaded it again. The kill's own time (the interrupter's log) splits it into
work lost and the restart.

The model (`per_interruption`, J. T. Daly 2006's assumptions, as dtlab.model.spot): with checkpoints every tau
seconds of work, each taking C, a cycle is L = tau + C long; a memoryless interruption with mean time between them
M lands in a cycle at a point u with density e^(-u/M) on [0, L), so it loses on average M - L / (e^(L/M) - 1) (L / 2
when M >> L), plus a restart of R seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy.stats import beta as beta_dist
from scipy.stats import poisson

from dtlab.course.claims import compare, spread
from dtlab.course.wording import show, text  # noqa: F401 - the lab's passages (lab12.figures, lab12.restart)
from dtlab.launching.interrupts import count_line, interrupted_run, kill_plan  # noqa: F401
from dtlab.results.cost import billed_devices, cost, epoch_samples, gpu_kind, samples_per_step
from dtlab.units import fmt_bytes, fmt_time

CONFIDENCE = 0.90  # the model's band: the interval that holds the median of the measured costs 90% of the time

# ---- the bill: what a cost is made of ----------------------------------------------------------------------


def bill_inputs(run, prices) -> dict:
    """What the bill of `run` is computed from, before it is computed: T_step (s), samples per step and per epoch,
    devices billed, and the price (a GpuPrice of `prices` for the run's devices)."""
    t = run.summary().set_index("quantity").loc["T_step"]
    per_step, step_how = samples_per_step(run)
    epoch, epoch_how = epoch_samples(run)
    devices, _, dev_how = billed_devices(run)
    return {
        "t_step_s": float(t["value"]),
        "samples_per_step": per_step,
        "step_how": step_how,
        "epoch_samples": epoch,
        "epoch_how": epoch_how,
        "devices": devices,
        "devices_how": dev_how,
        "price": prices.price(gpu_kind(run, prices)),
    }


def bill_lines(inputs: dict) -> list[str]:
    """The inputs of `bill_inputs` in words, with their units and sources (no cost: that is the question)."""
    p = inputs["price"]
    out = [
        f"T_step {fmt_time(inputs['t_step_s'])} (median over the measured steps of the slowest rank's step)",
        f"samples per step: {inputs['samples_per_step']:,} ({inputs['step_how']})",
        f"one epoch: {inputs['epoch_samples']:,} samples ({inputs['epoch_how']})",
        f"billed: {inputs['devices']} device(s): {inputs['devices_how']}",
        f"price: {p.kind} at ${p.on_demand:.2f} per {'machine' if p.kind == 'CPU' else 'GPU'}-hour on-demand, "
        f"${p.spot:.2f} spot; source: {p.source}; dated {p.date}",
    ]
    if p.example:
        out.append(
            "  an example price, not a market price: set your own with "
            "dtlab.example_prices().with_price(kind, on_demand=..., spot=..., source=..., date=...)"
        )
    return out


def scaling_view(scaling: pd.DataFrame) -> pd.DataFrame:
    """The scaling table of dtlab.cost with units in its column names (seconds, GPU-hours, USD), the model's band
    where the fit has one."""
    cols = {
        "gpus": "GPUs",
        "t_step_s": "t_step (s)",
        "speedup": "speedup (x)",
        "efficiency": "efficiency (fraction)",
        "steps": "steps",
        "wall_s": "wall (s)",
        "gpu_hours": "GPU-hours",
        "on_demand_usd": "on-demand (USD)",
        "spot_usd": "spot (USD)",
        "cheapest": "cheapest",
        "fastest": "fastest",
    }
    view = scaling[list(cols)].rename(columns=cols)
    if scaling["t_step_lo_s"].notna().all():
        view.insert(
            2, "t_step band (s)", [f"{a:.3g} .. {b:.3g}" for a, b in scaling[["t_step_lo_s", "t_step_hi_s"]].values]
        )
    return view


# ---- what questions 3 and 4 need, and what the table shows after them ------------------------------------


def scaling_inputs(run, profile, prices, samples) -> list[str]:
    """What the cheapest and fastest GPU counts follow from, printed before they are asked: the measured step at
    the run's own rank count, the model's T_step at 1 GPU (this run's compute, no all-reduce: the table's first
    row), the gradient bytes each step all-reduces and DDP's bucket cap, the batch per GPU and the samples to price.
    The counts themselves are the question: not here."""
    t = run.summary().set_index("quantity").loc["T_step"]
    one = cost(run, prices, profile=profile, gpu_counts=(1,), samples=samples).scaling
    grad = int(sum(run.resolved.get("param_nbytes") or []))
    per_gpu = int(run.config.batch_size) * int(run.config.ddp.accumulate)
    return [
        f"measured: T_step {fmt_time(t['value'])} at {run.nproc} ranks (90% interval {fmt_time(t['lo'])} .. "
        f"{fmt_time(t['hi'])}; the run above)",
        f"model: T_step {fmt_time(float(one['t_step_s'].iloc[0]))} at 1 GPU (this run's compute from its no-op "
        "hook steps: forward + backward + optimizer, nothing to all-reduce)",
        f"all-reduced per step and rank: {grad:,} B of gradients, in buckets of at most {run.config.ddp.bucket_mb:g} "
        "MiB (at p GPUs each bucket costs the fitted all-reduce time at p)",
        f"batch {per_gpu} samples per GPU per step: p GPUs take ceil(samples / ({per_gpu} p)) steps",
    ]


def devices_line(inputs: dict, nproc: int) -> str:
    """Where the bill and the scaling table count devices differently: the bill bills what the run held, the table
    one device per rank."""
    same = inputs["devices"] == nproc
    return (
        f"devices: the bill above billed {inputs['devices']} device(s) for this {nproc}-rank run "
        f"({inputs['devices_how']}); the table bills p devices at p GPUs, one rank per GPU"
        + ("" if same else f": its {nproc}-GPU row is this run moved to {nproc} GPUs of their own, not the bill above")
    )


def ratio_lines(scaling: pd.DataFrame) -> list[str]:
    """cost(p) / cost(1) beside 1 / efficiency(p) for every count: equal when samples divide into whole steps at
    both counts, apart by the rounding up of each count's steps (ceil(samples / (p x batch))) otherwise."""
    one = scaling.iloc[0]
    out = ["cost(p) / cost(1) against 1 / efficiency(p) (equal but for each count's steps rounded up):"]
    for r in scaling.itertuples():
        ratio = r.gpu_hours / one["gpu_hours"]
        out.append(
            f"  {int(r.gpus)} GPU(s): {ratio:.3g} against {1 / r.efficiency:.3g} ({int(r.steps):,} steps of "
            f"{fmt_time(r.t_step_s)} against {int(one['steps']):,} at 1 GPU)"
        )
    return out


def count_lines(work_s: float, mtbi_s: float, kills: int) -> list[str]:
    """The interruptions expected on the interrupter's own clock (training time, not restarts): work / M, a Poisson
    count, of which the run allows `kills`; and why the spot model's own count is not this one."""
    n = work_s / mtbi_s
    lo, hi = poisson_interval(n)
    all_k = float(poisson.sf(kills - 1, n))
    return [
        f"on the interrupter's clock (training time only): {fmt_time(work_s)} of work at M = {fmt_time(mtbi_s)} "
        f"expects {n:.3g} interruptions (Poisson: 90% of runs see {lo} to {hi}); the run allows {kills}, so "
        f"{all_k:.0%} of such runs stop after all {kills}",
        "  (the spot model's own count runs its clock through restarts and redone work too, which here take about "
        "as long as M: it counts the same way only when M is well above R)",
    ]


# ---- what each interruption cost, from the records ---------------------------------------------------------


def _resume_points(run) -> list[tuple[int, float]]:
    """(steps done, wall time s) of every moment a state the group could resume from was reached: the end of a
    checkpoint's save (slowest rank), a restart's load (slowest rank), and the start of training (step 0 of the
    first attempt: its end less its t_step, earliest rank)."""
    points = []
    ck = run.checkpoints
    if not ck.empty:
        for (_, step), g in ck.groupby(["attempt", "step"]):
            points.append((int(step), float(g["wall_time"].max())))
    rs = run.restarts
    if not rs.empty:
        for _, g in rs.groupby("attempt"):
            points.append((int(g["resumed_from"].min()), float(g["wall_time"].max())))
    first = pd.concat(
        [
            run.steps[["rank", "step", "attempt", "t_step", "time"]],
            run.lost.rename(columns={"wall_time": "time"})[["rank", "step", "attempt", "t_step", "time"]]
            if not run.lost.empty
            else None,
        ]
    )
    first = first[(first["step"] == 0) & (first["attempt"] == 0)]
    if not first.empty:
        points.append((0, float((first["time"] - first["t_step"]).min())))
    return points


def interruption_costs(run, log=()) -> pd.DataFrame:
    """One row per restart of `run`: attempt (the one that restarted), resumed_from (steps), safe_s (wall time the
    resumed state was reached), back_s (wall time the group had loaded it again: its slowest rank's restart
    record), cost_s = back_s - safe_s (s: the work lost plus the restart); with the interrupter's `log`, also
    killed_s, lost_s = killed_s - safe_s and restart_s = back_s - killed_s."""
    rows = []
    points = _resume_points(run)
    kills = {int(k["attempt"]) + 1: float(k["time"]) for k in log}
    if run.restarts.empty:
        return pd.DataFrame(columns=["attempt", "resumed_from", "safe_s", "back_s", "cost_s"])
    for a, g in run.restarts.groupby("attempt"):
        k, back = int(g["resumed_from"].min()), float(g["wall_time"].max())
        safe = max((t for s, t in points if s == k and t < back - 1e-9), default=math.nan)
        row = {"attempt": int(a), "resumed_from": k, "safe_s": safe, "back_s": back, "cost_s": back - safe}
        if int(a) in kills:
            row.update(killed_s=kills[int(a)], lost_s=kills[int(a)] - safe, restart_s=back - kills[int(a)])
        rows.append(row)
    return pd.DataFrame(rows)


# ---- the model, per interruption, and its band -------------------------------------------------------------


def expected_lost(interval_s: float, checkpoint_s: float, mtbi_s: float) -> float:
    """Expected work lost (s) by one memoryless interruption (mean time between them `mtbi_s`) in a cycle of
    interval_s of work and a checkpoint_s save: M - L / (e^(L/M) - 1), L = interval_s + checkpoint_s."""
    big_l, m = interval_s + checkpoint_s, mtbi_s
    return m - big_l / math.expm1(big_l / m)


def lost_quantile(q, interval_s: float, checkpoint_s: float, mtbi_s: float):
    """The q-quantile of the work lost by one interruption (density e^(-u/M) on [0, L))."""
    big_l, m = interval_s + checkpoint_s, mtbi_s
    return -m * np.log1p(-np.asarray(q, dtype=float) * -np.expm1(-big_l / m))


def median_band(n: int, interval_s: float, checkpoint_s: float, mtbi_s: float, confidence: float = CONFIDENCE):
    """(lo, hi) in seconds of lost work: the central `confidence` interval of the median of n interruptions' lost
    work (order statistics: the k-th smallest of n has F(U) ~ Beta(k, n + 1 - k); for an even n, the lower of the
    two middle ones' lower end and the upper one's upper end)."""
    tail = (1 - confidence) / 2
    lo_k, hi_k = (n + 1) // 2, n // 2 + 1
    q_lo = beta_dist.ppf(tail, lo_k, n + 1 - lo_k)
    q_hi = beta_dist.ppf(1 - tail, hi_k, n + 1 - hi_k)
    lo, hi = lost_quantile([q_lo, q_hi], interval_s, checkpoint_s, mtbi_s)
    return float(lo), float(hi)


def per_interruption(interval_s: float, checkpoint_s: float, restart_s: float, mtbi_s: float, n: int) -> dict:
    """The model's cost of one interruption (s): lost (expected work lost), restart (R), mean = lost + R, and the
    band of the median of n: lo_s, hi_s, rel_tol (the wider side over the mean)."""
    lost = expected_lost(interval_s, checkpoint_s, mtbi_s)
    lo, hi = median_band(n, interval_s, checkpoint_s, mtbi_s) if n > 0 else (math.nan, math.nan)
    mean = lost + restart_s
    rel = max(mean - (lo + restart_s), hi + restart_s - mean) / mean if n > 0 else math.nan
    return {
        "lost_s": lost,
        "restart_s": restart_s,
        "mean_s": mean,
        "lo_s": lo + restart_s,
        "hi_s": hi + restart_s,
        "rel_tol": rel,
    }


# ---- the claim ---------------------------------------------------------------------------------------------


def interruption_claim(
    costs: pd.DataFrame, interval_s: float, checkpoint_s: float, restart_s: float, mtbi_s: float, how: str
):
    """'Each interruption costs the work since the last checkpoint plus a restart' (the spot model's terms, with C,
    R and t_step measured in another run) against what each restart of the interrupted run cost (`costs`, from
    `interruption_costs`), interruption by interruption; the band is the model's own (`per_interruption`)."""
    n = len(costs)
    m = per_interruption(interval_s, checkpoint_s, restart_s, mtbi_s, n)
    measured = [float(c) for c in costs["cost_s"]]

    def why(outcome):
        parts = []
        if "lost_s" in costs:
            lost, back = spread(costs["lost_s"]), spread(costs["restart_s"])
            parts.append(
                f"work lost per interruption {fmt_time(lost.lo)} .. {fmt_time(lost.hi)} (the model: "
                f"{fmt_time(m['lost_s'])} on average, between 0 and one cycle of "
                f"{fmt_time(interval_s + checkpoint_s)}); "
                f"restarts {fmt_time(back.lo)} .. {fmt_time(back.hi)} against R = {fmt_time(restart_s)} measured "
                "from the one restart of the run before (that kill came at the start of a step, after a barrier; "
                "these came mid-step, while the other rank computed or waited in a collective)"
            )
        head = (
            "the interruptions disagree with each other (some inside the band, some outside)"
            if outcome == "inconclusive"
            else "every interruption cost more or less than the model's band allows"
        )
        return (
            f"{head}: {'; '.join(parts)}. The model takes R as a constant from one restart; a restart on shared "
            "cores (new processes, a checkpoint load) varies from one to the next, and so does a step."
        )

    return compare(
        "lab12.interruptions",
        "an interruption costs the work since the last complete checkpoint plus a restart: on average "
        "M - L/(e^(L/M) - 1) + R",
        "time lost per interruption (last checkpoint to loaded again)",
        ("measured", measured),
        ("model", [m["mean_s"]] * n),
        expected=1.0,
        model=f"L = tau + C = {fmt_time(interval_s)} + {fmt_time(checkpoint_s)}, M = {fmt_time(mtbi_s)}, "
        f"R = {fmt_time(restart_s)}: {fmt_time(m['lost_s'])} lost + R = {fmt_time(m['mean_s'])}; band: the "
        f"{CONFIDENCE:.0%} interval of the median of {n} interruptions, {fmt_time(m['lo_s'])} .. {fmt_time(m['hi_s'])}",
        rel_tol=m["rel_tol"],
        why=why,
        per="interruption",
        how=how,
    )


def totals_lines(
    run, costs: pd.DataFrame, tau_steps: int, t_step_s: float, checkpoint_s: float, restart_s: float, mtbi_s: float
) -> list[str]:
    """The interrupted run's wall time beside the model's for the interruptions it had: work + checkpoints +
    interruptions (each the model's mean), all in seconds."""
    n = len(costs)
    steps = int(run.steps["step"].nunique())
    work = steps * t_step_s
    saves = steps // tau_steps
    m = per_interruption(tau_steps * t_step_s, checkpoint_s, restart_s, mtbi_s, n)
    model = work + saves * checkpoint_s + n * m["mean_s"]
    first = _resume_points(run)
    start = min((t for s, t in first if s == 0), default=math.nan)
    wall = float(run.steps["time"].max()) - start
    ck = run.checkpoints.groupby(["attempt", "step"])["t_save"].max() if not run.checkpoints.empty else pd.Series()
    return [
        f"wall time, start of training to the last step: {fmt_time(wall)} measured",
        f"  model for {n} interruption(s): work {steps} steps x {fmt_time(t_step_s)} = {fmt_time(work)} + {saves} "
        f"checkpoints x C {fmt_time(checkpoint_s)} + {n} x {fmt_time(m['mean_s'])} = {fmt_time(model)} "
        f"(measured / model {wall / model:.2f})",
        f"  measured: {len(ck)} checkpoints saved ({fmt_time(float(ck.sum()))} in all, repeats included), "
        f"{n} interruption(s) costing {fmt_time(float(costs['cost_s'].sum()))} in all",
    ]


def poisson_interval(mean: float, confidence: float = CONFIDENCE) -> tuple[int, int]:
    """The central `confidence` interval of a Poisson count with this mean (interruptions in a run)."""
    tail = (1 - confidence) / 2
    return int(poisson.ppf(tail, mean)), int(poisson.ppf(1 - tail, mean))


# ---- section 5: the run on a real system's link (question 6) -------------------------------------------------


def real_buckets(run, link, nodes: int) -> pd.DataFrame:
    """What question 6 is computed from, before it is asked: the run's DDP buckets at its own cap, each as the bytes
    its all-reduce moves (nbytes: the bucket's gradient bytes x the run's bytes on the wire per gradient byte, 1
    without compression), in the order they are all-reduced, and, for each, the alpha (us) and bandwidth 1/beta
    (GB/s) of both levels of `link` (a TwoLevelLink) at that size: the regime of each level's piecewise fit the
    bucket falls in. No time: that is the question."""
    w = run.whatif(link, nproc=link.gpus_per_node, nodes=nodes)
    nbytes = w.setting["ratio"] * np.asarray(w.detail["bucket_nbytes"], dtype=float)
    a_in, b_in = link.intra.constants(nbytes)
    a_out, b_out = link.inter.constants(nbytes)
    return pd.DataFrame(
        {
            "bucket": range(len(nbytes)),
            "nbytes": np.round(nbytes).astype(int),
            "intra_alpha_us": np.asarray(a_in, dtype=float) * 1e6 * np.ones_like(nbytes),
            "intra_gbs": 1e-9 / (np.asarray(b_in, dtype=float) * np.ones_like(nbytes)),
            "inter_alpha_us": np.asarray(a_out, dtype=float) * 1e6 * np.ones_like(nbytes),
            "inter_gbs": 1e-9 / (np.asarray(b_out, dtype=float) * np.ones_like(nbytes)),
        }
    )


def real_lines(run, link, nodes: int) -> list[str]:
    """Where question 6's inputs come from: the run's gradients and cap, each level's source and its size regimes
    (alpha in us, 1/beta in GB/s), the ranks priced. No time: that is the question."""
    grad = int(sum(run.resolved.get("param_nbytes") or []))
    ratio = run.whatif(link, nproc=link.gpus_per_node, nodes=nodes).setting["ratio"]
    out = [
        f"the run: {grad:,} B of gradients per step, DDP buckets of at most {run.config.ddp.bucket_mb:g} MiB "
        f"({run.path}); the table below lists the bytes each bucket's all-reduce moves"
        + (f" (x {ratio:.3g}, its compression's bytes on the wire)" if ratio != 1 else ""),
        f"priced on {nodes} node(s) x {link.gpus_per_node} GPUs = {nodes * link.gpus_per_node} ranks, one ring over "
        "all of them, each step as slow as its slowest edge (TwoLevelLink, algorithm 'flat')",
    ]
    for name, lk in (("inside a node", link.intra), ("between nodes", link.inter)):
        out.append(f"{name}: {lk.source}")
        regs = lk.regimes or ()
        for r in regs or (lk,):
            bw = f"{1e-9 / r.beta:.3g} GB/s" if r.beta > 0 else "unlimited"
            sizes = f"regime {fmt_bytes(r.min_bytes)}..{fmt_bytes(r.max_bytes)}" if regs else "one line"
            out.append(f"  {sizes}: alpha {r.alpha * 1e6:.3g} us, 1/beta {bw}")
    return out
