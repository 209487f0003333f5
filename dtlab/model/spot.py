"""Spot instances and checkpoints: the expected wall time and money to finish a job that may be interrupted (pure;
seconds, USD, GPU-hours).

A job needs W seconds of work. Every tau seconds of work it saves a checkpoint, which takes C seconds; an
interruption throws away the work since the last complete checkpoint and costs R seconds to come back (notice,
get a new instance, start the processes, load the checkpoint): C and R are what lab 06 measures
(`checkpoint_s` and the restart's `down_s`, dtlab.model.restarts.measured_costs). Interruptions arrive as a
Poisson process with mean time between interruptions M seconds (rate 1/M). The expected wall time is then exactly
(J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future Generation
Computer Systems 22(3):303-312, 2006):

    T(tau) = M e^(R/M) (e^((tau + C)/M) - 1) W / tau          (seconds)

Assumptions, as Daly's: interruptions are memoryless and independent of what the job is doing, so they strike
during work, checkpoints and restarts alike (an interrupted restart restarts again); the work is W / tau
segments of tau seconds each followed by a checkpoint (the count is not rounded); C and R are constants; nothing
waits for capacity beyond R. Every second of T is billed at the same price (a restart's too: the new instance is
billed while it starts and loads). The expected number of interruptions is T / M. On-demand instances are taken
as never interrupted (M infinite: T = W (tau + C) / tau) unless `on_demand_mtbi_s` says otherwise.

T is smallest where e^((tau + C)/M) (1 - tau/M) = 1, i.e. at tau* = M (1 + W0(-e^-(1 + C/M))), W0 the principal
branch of Lambert's W (`optimal_interval`). To first order in tau/M, C/M and R/M, T ~ W (1 + waste) with Young's
waste C/tau + (tau/2 + R)/M (dtlab.model.restarts.checkpoint_tradeoff), smallest at Young's sqrt(2 C M); Daly's
higher-order estimate of tau* is dtlab.model.restarts.daly_interval. Both are reused from there, not restated.

Money = GPUs x T / 3600 x price (USD per GPU-hour); spot's price = on-demand's x (1 - discount).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy.special import lambertw

from dtlab.model.cost import EXAMPLE_ON_DEMAND, check_discount, check_number
from dtlab.model.restarts import checkpoint_tradeoff, daly_interval, young_interval

#: Default intervals around the optimum tau*: these multiples of it (those above W are left out, W is added).
INTERVAL_MULTIPLES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
PLAN_COLUMNS = [
    "interval_s",
    "checkpoints",
    "on_demand_wall_s",
    "on_demand_usd",
    "spot_wall_s",
    "spot_usd",
    "spot_interruptions",
    "first_order_wall_s",
    "cheaper",
]


def mean_time_between(mtbi_s: float | None = None, interruptions_per_hour: float | None = None) -> float:
    """M in seconds, from exactly one of `mtbi_s` (seconds) or `interruptions_per_hour` (rate, 1/h): M = 3600 / rate."""
    if (mtbi_s is None) == (interruptions_per_hour is None):
        raise ValueError("give exactly one of mtbi_s (mean seconds between interruptions) or interruptions_per_hour")
    if mtbi_s is not None:
        m = check_number("mtbi_s", mtbi_s, "seconds between interruptions")
        if m <= 0:
            raise ValueError(f"mtbi_s (seconds between interruptions) must be > 0, got {mtbi_s!r}")
        return m
    rate = check_number("interruptions_per_hour", interruptions_per_hour, "interruptions per hour")
    if rate <= 0:
        raise ValueError(
            f"interruptions_per_hour must be > 0 (a spot instance that is never interrupted: use on-demand's "
            f"formula, mtbi_s=math.inf), got {interruptions_per_hour!r}"
        )
    return 3600.0 / rate


def expected_time(work_s: float, interval_s, checkpoint_s: float, restart_s: float, mtbi_s: float):
    """Daly's exact expected wall time T (s) to finish `work_s` seconds of work, checkpointing every `interval_s`
    seconds of work (a number or an array), each checkpoint `checkpoint_s` s, each restart `restart_s` s, Poisson
    interruptions every `mtbi_s` s on average (math.inf: never, T = W (tau + C) / tau). See the module docstring."""
    w, c, r, m = _checked(work_s, checkpoint_s, restart_s, mtbi_s)
    tau = np.asarray(interval_s, dtype=float)
    if not np.all(np.isfinite(tau)) or np.any(tau <= 0):
        raise ValueError(f"interval_s (seconds of work between checkpoints) must be finite and > 0, got {interval_s!r}")
    if math.isinf(m):
        t = w * (tau + c) / tau
    else:
        t = m * math.exp(r / m) * np.expm1((tau + c) / m) * w / tau
    return float(t) if np.ndim(t) == 0 else t


def first_order_time(work_s: float, interval_s, checkpoint_s: float, restart_s: float, mtbi_s: float):
    """Young's first-order expected wall time W (1 + waste) in seconds, waste = C/tau + (tau/2 + R)/M as
    dtlab.model.restarts.checkpoint_tradeoff computes it: Daly's T to first order in tau/M, C/M and R/M."""
    w, c, r, m = _checked(work_s, checkpoint_s, restart_s, mtbi_s)
    tau = np.atleast_1d(np.asarray(interval_s, dtype=float))
    waste = checkpoint_tradeoff(1.0, c, m, every=tuple(tau), restart_s=r)["waste"].to_numpy()  # interval = every x 1 s
    t = w * (1.0 + waste)
    return float(t[0]) if np.ndim(interval_s) == 0 else t


def optimal_interval(checkpoint_s: float, mtbi_s: float) -> float:
    """The interval tau* (s of work between checkpoints) that minimises Daly's exact T: M (1 + W0(-e^-(1 + C/M))).
    It does not depend on W or R (they scale T or multiply it by a constant); math.inf when M is."""
    c = check_number("checkpoint_s", checkpoint_s, "seconds")
    if c <= 0:
        raise ValueError(
            f"checkpoint_s must be > 0 seconds for an optimum (a free checkpoint is taken continuously, "
            f"T -> W e^(R/M)), got {checkpoint_s!r}"
        )
    m = math.inf if mtbi_s == math.inf else mean_time_between(mtbi_s=mtbi_s)
    if math.isinf(m):
        return math.inf
    x = 1.0 + lambertw(-math.exp(-(1.0 + c / m)), 0).real  # tau* / M
    for _ in range(3):  # Newton on (x + C/M) + log(1 - x) = 0: W0 loses digits near its branch point (small C/M)
        if 0.0 < x < 1.0:
            x -= (x + c / m + math.log1p(-x)) / (-x / (1.0 - x))
    return float(m * x)


def _checked(work_s, checkpoint_s, restart_s, mtbi_s) -> tuple[float, float, float, float]:
    w = check_number("work_s", work_s, "seconds of work")
    if w <= 0:
        raise ValueError(f"work_s (seconds of work) must be > 0, got {work_s!r}")
    c = check_number("checkpoint_s", checkpoint_s, "seconds")
    r = check_number("restart_s", restart_s, "seconds")
    m = math.inf if mtbi_s == math.inf else mean_time_between(mtbi_s=mtbi_s)
    return w, c, r, m


@dataclass
class SpotPlan:
    """`spot_plan`'s answer (seconds, GPU-hours, USD).

    table: one row per checkpoint interval: interval_s, checkpoints (W / tau), on_demand_wall_s and on_demand_usd,
    spot_wall_s (Daly's exact T), spot_usd, spot_interruptions (expected, T / M), first_order_wall_s (Young's
    W (1 + waste), for comparison) and cheaper ('spot', 'on-demand' or 'same').
    best: one row per choice of interval (spot at the exact optimum, at Young's and at Daly's estimate, and
    on-demand at its own best): choice, interval_s, wall_s, gpu_hours, usd, interruptions.
    inputs: what it was computed from; notes: what was assumed or clipped."""

    table: pd.DataFrame
    best: pd.DataFrame
    inputs: dict
    notes: list = field(default_factory=list)

    def lines(self) -> list[str]:
        """The plan in words: the inputs, each choice of interval, and spot against on-demand at their best."""
        i = self.inputs
        out = [
            f"{i['work_s'] / 3600:.3g} h of work on {i['gpus']} GPU(s); interruptions every {i['mtbi_s'] / 3600:.3g} h "
            f"on average (Poisson); checkpoint C {i['checkpoint_s']:.3g} s, restart R {i['restart_s']:.3g} s; "
            f"on-demand ${i['on_demand_usd_per_gpu_hour']:.2f} per GPU-hour, spot {i['discount']:.0%} off "
            f"(${i['spot_usd_per_gpu_hour']:.2f})"
        ]
        for b in self.best.itertuples():
            out.append(
                f"  {b.choice}: checkpoint every {b.interval_s:.4g} s of work -> {b.wall_s / 3600:.4g} h, "
                f"{b.gpu_hours:.4g} GPU-hours, ${b.usd:,.2f}, {b.interruptions:.3g} interruptions expected"
            )
        spot, od = self.best.iloc[0], self.best.iloc[-1]
        word = "saves" if spot["usd"] < od["usd"] else "costs"
        out.append(
            f"  spot at its optimum {word} ${abs(od['usd'] - spot['usd']):,.2f} against on-demand and takes "
            f"{(spot['wall_s'] - od['wall_s']) / 3600:+.3g} h"
        )
        return out + [f"  note: {n}" for n in self.notes]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def spot_plan(
    work_s: float,
    *,
    checkpoint_s: float,
    restart_s: float,
    mtbi_s: float | None = None,
    interruptions_per_hour: float | None = None,
    discount: float = 0.5,
    on_demand_usd_per_gpu_hour: float = EXAMPLE_ON_DEMAND,
    gpus: int = 1,
    intervals=None,
    on_demand_mtbi_s: float = math.inf,
) -> SpotPlan:
    """Expected wall time and money to finish `work_s` seconds of work at each checkpoint interval, on-demand beside
    spot, and the best interval (see the module docstring for the formula and its assumptions).

    checkpoint_s C (> 0), restart_s R: seconds (lab 06 measures both: dtlab.model.restarts.measured_costs);
    interruptions: exactly one of mtbi_s (mean seconds between them) or interruptions_per_hour; discount: spot's
    price is the on-demand price x (1 - discount), in [0, 1); on_demand_usd_per_gpu_hour: USD (default: the course's
    example $2; a `GpuPrice` gives both: `on_demand_usd_per_gpu_hour=p.on_demand, discount=p.discount`); gpus: the
    devices billed; intervals: seconds of work between checkpoints, each in (0, work_s] (default: multiples of the
    optimum tau* and W itself); on_demand_mtbi_s: on-demand's own interruptions (default never)."""
    w, c, r, m = _checked(work_s, checkpoint_s, restart_s, mean_time_between(mtbi_s, interruptions_per_hour))
    disc = check_discount(discount)
    od_price = check_number("on_demand_usd_per_gpu_hour", on_demand_usd_per_gpu_hour, "USD per GPU-hour")
    if isinstance(gpus, bool) or not isinstance(gpus, (int, np.integer)) or gpus < 1:
        raise ValueError(f"gpus must be a whole number >= 1 (devices billed), got {gpus!r}")
    od_m = math.inf if on_demand_mtbi_s == math.inf else mean_time_between(mtbi_s=on_demand_mtbi_s)
    tau_star = optimal_interval(c, m)
    prices = {"on-demand": od_price, "spot": od_price * (1.0 - disc)}
    terms = dict(w=w, c=c, r=r, gpus=int(gpus), prices=prices)
    best, notes = _best(
        terms,
        [
            ("spot, exact optimum", tau_star, m, "spot"),
            ("spot, Young's sqrt(2CM)", young_interval(c, m), m, "spot"),
            ("spot, Daly's estimate", daly_interval(c, m), m, "spot"),
            ("on-demand, its best", w if math.isinf(od_m) else optimal_interval(c, od_m), od_m, "on-demand"),
        ],
    )
    inputs = dict(
        work_s=w,
        checkpoint_s=c,
        restart_s=r,
        mtbi_s=m,
        discount=disc,
        on_demand_usd_per_gpu_hour=od_price,
        spot_usd_per_gpu_hour=prices["spot"],
        gpus=int(gpus),
        on_demand_mtbi_s=od_m,
    )
    table = _table(terms, _intervals(w, tau_star, intervals), m, od_m)
    return SpotPlan(table=table, best=best, inputs=inputs, notes=notes)


def _intervals(w: float, tau_star: float, intervals) -> np.ndarray:
    if intervals is None:
        return np.asarray(sorted({min(w, k * tau_star) for k in INTERVAL_MULTIPLES} | {w}))
    taus = sorted({float(t) for t in np.atleast_1d(np.asarray(intervals, dtype=float))})
    if not taus or any(not math.isfinite(t) or t <= 0 or t > w for t in taus):
        raise ValueError(
            f"intervals (seconds of work between checkpoints) must each be in (0, work_s = {w:g}], got {intervals!r}"
        )
    return np.asarray(taus)


def _usd(terms: dict, kind: str, wall_s):
    """USD of `wall_s` seconds on terms' GPUs at the kind's price (USD per GPU-hour)."""
    return terms["gpus"] * np.asarray(wall_s, dtype=float) / 3600.0 * terms["prices"][kind]


def _table(terms: dict, tau: np.ndarray, m: float, od_m: float) -> pd.DataFrame:
    w, c, r = terms["w"], terms["c"], terms["r"]
    od_t, sp_t = expected_time(w, tau, c, r, od_m), expected_time(w, tau, c, r, m)
    table = pd.DataFrame(
        {
            "interval_s": tau,
            "checkpoints": w / tau,
            "on_demand_wall_s": od_t,
            "on_demand_usd": _usd(terms, "on-demand", od_t),
            "spot_wall_s": sp_t,
            "spot_usd": _usd(terms, "spot", sp_t),
            "spot_interruptions": sp_t / m,
            "first_order_wall_s": first_order_time(w, tau, c, r, m),
        }
    )
    sp, od = table["spot_usd"], table["on_demand_usd"]
    table["cheaper"] = np.where(sp < od, "spot", np.where(sp > od, "on-demand", "same"))
    return table[PLAN_COLUMNS]


def _best(terms: dict, choices: list) -> tuple[pd.DataFrame, list[str]]:
    """One row per (name, interval, M, price kind); an interval outside (0, W] is taken as W, with a note."""
    w, c, r = terms["w"], terms["c"], terms["r"]
    rows, notes = [], []
    for name, t, mm, kind in choices:
        if not 0 < t <= w:
            notes.append(f"{name}: interval {t:.4g} s is outside (0, W = {w:.4g} s]; taken as W (one checkpoint)")
            t = w
        wall = expected_time(w, t, c, r, mm)
        rows.append(
            {
                "choice": name,
                "interval_s": t,
                "wall_s": wall,
                "gpu_hours": terms["gpus"] * wall / 3600.0,
                "usd": float(_usd(terms, kind, wall)),
                "interruptions": wall / mm if math.isfinite(mm) else 0.0,
            }
        )
    return pd.DataFrame(rows), notes
