"""Time to accuracy = steps to accuracy (a measured curve) x T_step (the alpha-beta model for that lever and p).

MLPerf Training measures time to a target quality, not step time. A lever that shrinks communication can need more
steps: local SGD drifts between averages, PowerSGD sends an approximation (with error feedback), an asynchronous
server applies stale gradients. Which lever reaches the target first depends on both factors, and the second one
depends on the machine, so the composition predicts it for machines never run on:

    time to target (lever) = steps to target (lever, measured here) x T_step (lever; alpha, beta, p, T_comp)

Step-time forms on one link (dtlab.model.link.Link: alpha, beta and the all-reduce's form, 'ring' or 'textbook',
dtlab.model.costmodel), all collectives exposed (no overlap: an upper bound that DDP's bucket overlap lowers,
dtlab.model.whatif):

- synchronous ('sync', the baseline): T_comp + T_allreduce(n, p);
- local SGD with period H ('local_sgd'): T_comp + T_allreduce(n, p) / H (one average of all n parameter bytes
  every H steps);
- compression with ratio r and encode time e ('compressed'): T_comp + e + T_allreduce(r n, p) (PowerSGD's two
  or three smaller all-reduces priced as one of its bytes on the wire);
- asynchronous server with W = p workers ('async'): time per applied update
  max((T_comp + 2 (alpha + beta n)) / W, 2 (alpha + beta n) + t_apply): W workers each push n bytes and pull n bytes
  per gradient (one message each way, the textbook parameter-server form), and the server's one link carries
  both for every update and applies it (t_apply, its optimizer step).

The steps to target come from a run at one p and batch; at another p they are assumed unchanged: an assumption (a
larger global batch needs fewer steps only up to a critical batch size, McCandlish et al. 2018, and asynchrony's
staleness grows with W), which every table here states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtlab.config.strategies import strategy_spec
from dtlab.model.compression import compression_from_run
from dtlab.model.link import one_level

KINDS = ("sync", "local_sgd", "compressed", "async")
ASSUMPTION = (
    "steps to target measured at one p and batch, assumed the same at other p (McCandlish et al. 2018: "
    "true only below the critical batch size)"
)


@dataclass(frozen=True)
class Lever:
    """One lever as the model sees it: `kind` (KINDS), its measured `steps` to the target (None: never reached),
    `period` H (local SGD), `ratio` r and `encode_s` (compression), `source` (where `steps` came from)."""

    label: str
    kind: str
    steps: int | None
    period: int = 1
    ratio: float = 1.0
    encode_s: float = 0.0
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.steps is not None and (not isinstance(self.steps, (int, np.integer)) or self.steps < 0):
            raise ValueError(f"steps must be a whole number >= 0 or None (never reached), got {self.steps!r}")
        if not (isinstance(self.period, (int, np.integer)) and self.period >= 1):
            raise ValueError(f"period must be an integer >= 1, got {self.period!r}")
        if not (self.ratio > 0 and math.isfinite(self.ratio)):
            raise ValueError(f"ratio must be a positive number, got {self.ratio!r}")
        if not (self.encode_s >= 0 and math.isfinite(self.encode_s)):
            raise ValueError(f"encode_s must be >= 0 seconds, got {self.encode_s!r}")


def step_time(
    lever: Lever,
    *,
    t_comp: float,
    nbytes: float,
    nproc: int,
    link,
    t_apply: float = 0.0,
) -> float:
    """Predicted seconds per optimizer step (per applied update for 'async') of `lever` (see the module's
    docstring): t_comp the compute of one step (s), nbytes the gradient bytes, nproc p (the workers for 'async'),
    link a Link or a Profile (alpha s, beta s/B and the all-reduce's form), t_apply the server's optimizer step (s,
    'async' only)."""
    lk = one_level(link)
    if lever.kind == "async":
        msg = lk.alpha + lk.beta * nbytes  # one message of n bytes each way per gradient
        return float(max((t_comp + 2 * msg) / max(1, nproc), 2 * msg + t_apply))
    ar = float(lk.time("all_reduce", nbytes * lever.ratio, nproc))
    if lever.kind == "local_sgd":
        return float(t_comp + ar / lever.period)
    if lever.kind == "compressed":
        return float(t_comp + lever.encode_s + ar)
    return float(t_comp + ar)


def time_to_target(
    levers,
    *,
    t_comp: float,
    nbytes: float,
    nproc: int,
    link,
    t_apply: float = 0.0,
) -> pd.DataFrame:
    """One row per lever: label, kind, steps (measured), t_step (predicted s on `link`, a Link or a Profile: see
    :func:`step_time`), time (steps x t_step, s; NaN when the lever never reached the target), rank (1 = first to
    the target)."""
    rows = []
    lk = one_level(link)
    for lv in levers:
        t = step_time(lv, t_comp=t_comp, nbytes=nbytes, nproc=nproc, link=lk, t_apply=t_apply)
        rows.append(
            {
                "label": lv.label,
                "kind": lv.kind,
                "steps": lv.steps,
                "t_step": t,
                "time": float(lv.steps * t) if lv.steps is not None else float("nan"),
            }
        )
    df = pd.DataFrame(rows)
    df["rank"] = df["time"].rank(method="min")
    return df


def first_to_target(table: pd.DataFrame) -> str | None:
    """The label of the lever with the shortest predicted time (None when none reached the target)."""
    t = table.dropna(subset=["time"])
    return None if t.empty else str(t.loc[t["time"].idxmin(), "label"])


def crossover_bandwidth(
    lever: Lever,
    reference: Lever,
    *,
    t_comp: float,
    nbytes: float,
    nproc: int,
    link,
    t_apply: float = 0.0,
    lo_gbs: float = 1e-3,
    hi_gbs: float = 1e4,
) -> float | None:
    """The link bandwidth (GB/s, 1/beta) at which `lever` and `reference` reach the target at the same time on
    `link` (a Link or a Profile) with its bandwidth changed, its alpha and form kept, found by bisection on a log
    scale between lo_gbs and hi_gbs: below it the lever that moves fewer bytes wins, above it the one that needs
    fewer steps. None when they do not cross in that range (or one never reaches the target)."""
    if lever.steps is None or reference.steps is None:
        return None
    lk = one_level(link)

    def gap(gbs: float) -> float:
        kw = dict(t_comp=t_comp, nbytes=nbytes, nproc=nproc, link=lk.replace(beta=1.0 / (gbs * 1e9)), t_apply=t_apply)
        return lever.steps * step_time(lever, **kw) - reference.steps * step_time(reference, **kw)

    a, b = math.log(lo_gbs), math.log(hi_gbs)
    ga, gb = gap(lo_gbs), gap(hi_gbs)
    if ga == 0:
        return lo_gbs
    if ga * gb > 0:
        return None
    for _ in range(100):
        m = (a + b) / 2
        gm = gap(math.exp(m))
        if (gm > 0) == (ga > 0):
            a, ga = m, gm
        else:
            b = m
    return float(math.exp((a + b) / 2))


def lever_from_run(label: str, run, target: float) -> Lever:
    """A Lever from a recorded run (a dtlab Run): its kind and parameters from the config, steps to `target` from its
    evaluations, compression's r and encode time measured from its buckets (dtlab.model.compression)."""
    cfg = run.config
    steps = run.steps_to(target)
    source = f"measured: {run.path}, first evaluation at or above {target:g}"
    if strategy_spec(cfg.strategy).asynchronous:
        return Lever(label, "async", steps, source=source)
    if cfg.sync.local_sgd:
        return Lever(label, "local_sgd", steps, period=int(cfg.sync.local_sgd), source=source)
    if cfg.compression.hook != "none":
        c = compression_from_run(run)
        return Lever(label, "compressed", steps, ratio=c["ratio"], encode_s=c["encode_s"], source=source)
    return Lever(label, "sync", steps, source=source)
