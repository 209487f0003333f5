"""What distributed training costs, as data: a price table the user edits, and cost across GPU counts (pure).

Units: prices in USD per GPU-hour (for kind 'CPU': per machine-hour, one machine per node); times in seconds;
GPU-hours = GPUs x seconds / 3600; cost (USD) = GPU-hours x price.

- `GpuPrice`: one kind of device, its on-demand and spot prices, where they come from and when.
- `PriceTable`: the rows a cost is priced with; `example_prices()` is the shipped example (below), which the user
  replaces or edits (`with_price`). Prices change and differ by provider, region and commitment: set your own.
- `scaling(...)`: a what-if DDP step (the run's, dtlab.results.whatif) at each GPU count, and what a fixed number of
  samples costs there: speedup, scaling efficiency, the cheapest and the fastest count, with the link's interval
  carried through when it has one (never invented when it has not).

The shipped example is not a market price. It is the course's own example figure, "8 GPUs x $2/hour = $16/hour,
spot instances about 50 % cheaper", applied to every kind alike on purpose: no provider's price list was read for
it, so it cannot tell an H100 from an H200 (or a CPU machine, usually far cheaper). It makes the arithmetic run.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

#: The course's example figure: 8 GPUs x $2/hour = $16/hour; spot about 50 % cheaper.
EXAMPLE_ON_DEMAND = 2.0  # USD per GPU-hour
EXAMPLE_SPOT = 1.0  # USD per GPU-hour: 50 % off
EXAMPLE_DATE = "2026-11-27"
EXAMPLE_SOURCE = (
    "example, not a market price: the course's figure '8 GPUs x $2/hour = $16/hour, spot about 50 % cheaper', "
    "the same for every kind (no provider's price list used); set your own"
)
EXAMPLE_KINDS = ("H100", "H200", "A100", "CPU")
SCALING_COLUMNS = [
    "gpus",
    "samples_per_step",
    "t_step_s",
    "t_step_lo_s",
    "t_step_hi_s",
    "samples_per_s",
    "speedup",
    "efficiency",
    "steps",
    "wall_s",
    "gpu_hours",
    "on_demand_usd",
    "spot_usd",
    "on_demand_usd_lo",
    "on_demand_usd_hi",
    "spot_usd_lo",
    "spot_usd_hi",
    "cheapest",
    "fastest",
]


def check_number(field: str, value, unit: str, minimum: float = 0.0) -> float:
    """`value` as a finite float >= minimum, or a ValueError naming the field, its unit and what is allowed."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) < minimum:
        raise ValueError(f"{field} ({unit}) must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def check_date(field: str, value: str) -> str:
    """`value` if it is an ISO date (YYYY-MM-DD), else a ValueError naming the field."""
    try:
        datetime.date.fromisoformat(str(value))
    except ValueError:
        raise ValueError(f"{field} must be a date as YYYY-MM-DD (when the price was read), got {value!r}") from None
    return str(value)


@dataclass(frozen=True, kw_only=True)
class GpuPrice:
    """What one hour of one device of a kind costs, on-demand and spot, and where that figure comes from."""

    kind: str
    """The device kind, e.g. 'H100' (matched against a run's device names, case-insensitive)."""
    on_demand: float
    """USD per GPU-hour on-demand (kind 'CPU': per machine-hour), finite and >= 0."""
    spot: float
    """USD per GPU-hour as a spot (preemptible) instance: finite, >= 0 and at most `on_demand`."""
    source: str = ""
    """Where the figure comes from (a provider's page, a quote, the course's example)."""
    date: str = EXAMPLE_DATE
    """When it was read, YYYY-MM-DD: prices change."""
    example: bool = False
    """True for the shipped example figures: printed costs say so."""

    def __post_init__(self):
        if not isinstance(self.kind, str) or not self.kind.strip():
            raise ValueError(f"kind must be a non-empty name such as 'H100', got {self.kind!r}")
        where = f"prices[{self.kind!r}]"
        on_demand = check_number(f"{where}.on_demand", self.on_demand, "USD per GPU-hour")
        spot = check_number(f"{where}.spot", self.spot, "USD per GPU-hour")
        if spot > on_demand:
            raise ValueError(
                f"{where}.spot ({spot:g} USD per GPU-hour) must be at most its on_demand price ({on_demand:g})"
            )
        check_date(f"{where}.date", self.date)
        object.__setattr__(self, "on_demand", on_demand)
        object.__setattr__(self, "spot", spot)

    @property
    def unit(self) -> str:
        """The unit of this row's prices: 'USD per GPU-hour', or 'USD per machine-hour' for kind 'CPU'."""
        return "USD per machine-hour" if self.kind.strip().lower() == "cpu" else "USD per GPU-hour"

    @property
    def discount(self) -> float:
        """Spot's discount as a fraction of the on-demand price, 1 - spot / on_demand (NaN when on_demand is 0)."""
        return 1.0 - self.spot / self.on_demand if self.on_demand > 0 else float("nan")


@dataclass(frozen=True)
class PriceTable:
    """The prices a cost is computed with: one `GpuPrice` per kind (kinds unique, case-insensitive).

    `example_prices()` is the shipped example; `with_price(kind, on_demand, spot=... | discount=...)` returns a
    copy with one kind added or replaced; `from_frame` reads a table the user keeps (columns kind, on_demand,
    spot, and optionally source and date); `frame()` shows it with units."""

    rows: tuple[GpuPrice, ...]

    def __post_init__(self):
        if not self.rows or not all(isinstance(r, GpuPrice) for r in self.rows):
            raise ValueError("rows must be a non-empty sequence of GpuPrice (one per device kind)")
        seen = [r.kind.lower() for r in self.rows]
        twice = sorted({k for k in seen if seen.count(k) > 1})
        if twice:
            raise ValueError(f"rows: each kind must appear once, got {twice} more than once")
        object.__setattr__(self, "rows", tuple(self.rows))

    def kinds(self) -> list[str]:
        """The kinds priced, in table order."""
        return [r.kind for r in self.rows]

    def price(self, kind: str) -> GpuPrice:
        """The row of `kind` (case-insensitive); a ValueError naming `gpu` and the kinds there are otherwise."""
        for r in self.rows:
            if isinstance(kind, str) and r.kind.lower() == kind.strip().lower():
                return r
        raise ValueError(
            f"gpu {kind!r} is not in the price table: kinds are {', '.join(map(repr, self.kinds()))} "
            f"(add one with prices.with_price({kind!r}, on_demand=..., spot=...))"
        )

    def with_price(
        self, kind: str, on_demand: float, spot: float | None = None, *, discount: float | None = None, **about
    ) -> PriceTable:
        """A copy with `kind` priced at `on_demand` USD per GPU-hour and `spot` (or on_demand x (1 - discount),
        discount in [0, 1)); `about`: source and date (YYYY-MM-DD, default today)."""
        if (spot is None) == (discount is None):
            raise ValueError("with_price needs exactly one of spot (USD per GPU-hour) or discount (fraction)")
        if discount is not None:
            spot = check_number("on_demand", on_demand, "USD per GPU-hour") * (1.0 - check_discount(discount))
        row = GpuPrice(
            kind=kind,
            on_demand=on_demand,
            spot=spot,
            source=about.pop("source", "set by the user"),
            date=about.pop("date", datetime.date.today().isoformat()),
        )
        if about:
            raise ValueError(f"with_price takes source and date besides the prices, got {sorted(about)}")
        others = tuple(r for r in self.rows if r.kind.lower() != kind.strip().lower())
        return PriceTable(others + (row,))

    def frame(self) -> pd.DataFrame:
        """One row per kind: kind, on_demand_usd_per_gpu_hour, spot_usd_per_gpu_hour, spot_discount (fraction),
        source, date, example."""
        return pd.DataFrame(
            [
                {
                    "kind": r.kind,
                    "on_demand_usd_per_gpu_hour": r.on_demand,
                    "spot_usd_per_gpu_hour": r.spot,
                    "spot_discount": r.discount,
                    "source": r.source,
                    "date": r.date,
                    "example": r.example,
                }
                for r in self.rows
            ]
        )

    @classmethod
    def from_frame(cls, df: pd.DataFrame, source: str = "set by the user", date: str | None = None) -> PriceTable:
        """A table from a DataFrame with columns kind, on_demand, spot (USD per GPU-hour), optionally source and
        date per row (else `source` and `date`, default today)."""
        missing = [c for c in ("kind", "on_demand", "spot") if c not in df.columns]
        if missing:
            raise ValueError(f"prices: the table needs columns kind, on_demand, spot; missing {missing}")
        day = date or datetime.date.today().isoformat()
        rows = [
            GpuPrice(
                kind=r["kind"],
                on_demand=r["on_demand"],
                spot=r["spot"],
                source=str(r.get("source", source)),
                date=str(r.get("date", day)),
            )
            for r in df.to_dict("records")
        ]
        return cls(tuple(rows))


def example_prices() -> PriceTable:
    """The shipped example: H100, H200, A100 and CPU each at $2 per GPU-hour on-demand and $1 spot, the course's
    example figure (see the module docstring), dated when it was written into dtlab. Not a market price."""
    return PriceTable(
        tuple(
            GpuPrice(
                kind=k,
                on_demand=EXAMPLE_ON_DEMAND,
                spot=EXAMPLE_SPOT,
                source=EXAMPLE_SOURCE,
                date=EXAMPLE_DATE,
                example=True,
            )
            for k in EXAMPLE_KINDS
        )
    )


def check_discount(discount) -> float:
    """A spot discount as a fraction in [0, 1) (0.5: half the on-demand price), or a ValueError naming `discount`."""
    ok = isinstance(discount, (int, float, np.integer, np.floating)) and not isinstance(discount, bool)
    if not ok or not math.isfinite(float(discount)) or not 0.0 <= float(discount) < 1.0:
        raise ValueError(f"discount (fraction of the on-demand price) must be in [0, 1), got {discount!r}")
    return float(discount)


def scaling(step_s, link, gpu_counts, samples_per_gpu_step: int, samples: float, price: GpuPrice) -> pd.DataFrame:
    """Time per step, speedup, scaling efficiency and the cost of `samples` samples at each GPU count (one rank per
    GPU, data parallel), from a what-if DDP step.

    step_s(p, link): predicted seconds of one step at p GPUs on `link` (dtlab.results.cost passes
    dtlab.results.whatif.whatif of the run: its compute, readiness and the link's contention and stretch); link: a
    dtlab.model.link Link or TwoLevelLink, whose band (`link.bounds()`) is pushed through `step_s` too;
    samples_per_gpu_step: samples one rank trains on per step. Weak scaling: a fixed per-rank batch, so p GPUs train
    p x samples_per_gpu_step samples a step.

    Per count p: t_step_s (what-if, s), samples_per_s, speedup = throughput(p) / throughput(1) = p t_step(1) /
    t_step(p), efficiency = speedup / p, steps = ceil(samples / (p x samples_per_gpu_step)), wall_s = steps x
    t_step, gpu_hours = p x wall_s / 3600, on_demand_usd and spot_usd = gpu_hours x the price (USD per GPU-hour).
    `cheapest` marks the fewest GPU-hours (the lowest cost at either price), `fastest` the shortest wall time (the
    first count on a tie). The band (t_step_lo_s, t_step_hi_s and the *_lo, *_hi costs) is the link's interval of
    alpha and beta pushed through the step, or NaN; `attrs["band"]` says which and why."""
    counts = sorted({_gpu_count(p) for p in gpu_counts})
    if not counts:
        raise ValueError("gpu_counts must list at least one GPU count (integers >= 1)")
    per_gpu = check_number("samples_per_gpu_step", samples_per_gpu_step, "samples", minimum=1)
    samples = check_number("samples", samples, "samples", minimum=1)
    t1 = float(step_s(1, link))
    ends = link.bounds()
    band_how = (
        "the link's fitted intervals of alpha and beta (lower ends at least 0), pushed through the what-if step: "
        "how well the line fits the calibration, not the model's error at other GPU counts"
        if ends
        else "unknown: the link has no interval for alpha and beta (a profile of recorded figures only, a Link by "
        "hand, or too few points), and no other band is assumed"
    )
    rows = []
    for p in counts:
        t = float(step_s(p, link))
        lo, hi = (float(step_s(p, ends[0])), float(step_s(p, ends[1]))) if ends else (np.nan, np.nan)
        steps = math.ceil(samples / (per_gpu * p))
        hours = p * steps / 3600.0  # GPU-hours per second of step time
        rows.append(
            {
                "gpus": p,
                "samples_per_step": per_gpu * p,
                "t_step_s": t,
                "t_step_lo_s": lo,
                "t_step_hi_s": hi,
                "samples_per_s": per_gpu * p / t,
                "speedup": p * t1 / t,
                "efficiency": t1 / t,
                "steps": steps,
                "wall_s": steps * t,
                "gpu_hours": hours * t,
                "on_demand_usd": hours * t * price.on_demand,
                "spot_usd": hours * t * price.spot,
                "on_demand_usd_lo": hours * lo * price.on_demand,
                "on_demand_usd_hi": hours * hi * price.on_demand,
                "spot_usd_lo": hours * lo * price.spot,
                "spot_usd_hi": hours * hi * price.spot,
            }
        )
    df = pd.DataFrame(rows)
    df["cheapest"] = df.index == df["gpu_hours"].idxmin()
    df["fastest"] = df.index == df["wall_s"].idxmin()
    df = df[SCALING_COLUMNS]
    df.attrs.update(band=band_how, samples=samples, form=link.form, kind=price.kind)
    return df


def _gpu_count(p) -> int:
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1:
        raise ValueError(f"gpu_counts must hold whole numbers >= 1 (GPUs), got {p!r}")
    return int(p)
