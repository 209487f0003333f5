"""How busy the machine was while a run's steps ran, from the `machine` events its ranks recorded (pure).

Every rank of a DDP run records its own CPU time when its steps start and when they end; rank 0 adds the machine's
counters (dtlab.config.busy). Other processes' CPU time is what the machine counted busy meanwhile, less what the
ranks on rank 0's host took themselves. The state is `busy` when other processes took at least
`BUSY_OTHER_CORES` cores' worth or CPU steal reached `BUSY_STEAL` (dtlab.config.busy); then the breakdown's
intervals resample blocks of consecutive steps (dtlab.results.spread) and the line says the figures were widened.
"""

from __future__ import annotations

import math

import numpy as np

from dtlab.config.busy import between, is_busy


def machine_load(run) -> dict | None:
    """other_s, other_cores, steal, wall_s, cores, loadavg_start, loadavg_end over the run's steps (every attempt
    of a restarted run added up); None when the run recorded no machine counters (strategies other than 'ddp' and
    'ps', and runs made before dtlab recorded them)."""
    pairs: dict = {}
    for e in getattr(run, "machine", []) or []:
        pairs.setdefault((e.get("rank"), e.get("attempt")), {})[e.get("phase")] = e
    done = {k: p for k, p in pairs.items() if "start" in p and "end" in p}
    zero = [p for (r, _), p in sorted(done.items(), key=lambda kv: str(kv[0][1])) if r == 0 and p["start"].get("stat")]
    if not zero:
        return None
    hosts = dict(zip(run.ranks["rank"], run.ranks["host"])) if "host" in run.ranks.columns else {}
    here = hosts.get(0)
    own = sum(
        float(p["end"]["cpu_s"]) - float(p["start"]["cpu_s"])
        for (r, _), p in done.items()
        if here is None or hosts.get(r, here) == here
    )
    figs = [between(p["start"], p["end"], 0.0) for p in zero]
    wall = sum(f["wall_s"] for f in figs)
    busy = sum(f["busy_s"] for f in figs if f["busy_s"] is not None)
    other = max(busy - own, 0.0)
    cpu_total = sum(f["wall_s"] * float(p["end"].get("cores") or 1) for f, p in zip(figs, zero))
    steal = (
        sum((f["steal"] or 0.0) * f["wall_s"] * float(p["end"].get("cores") or 1) for f, p in zip(figs, zero))
        / cpu_total
        if cpu_total > 0
        else 0.0
    )
    return {
        "other_s": other,
        "other_cores": other / wall if wall > 0 else math.nan,
        "steal": steal,
        "wall_s": wall,
        "own_s": own,
        "cores": zero[-1]["end"].get("cores"),
        "loadavg_start": zero[0]["start"].get("loadavg"),
        "loadavg_end": zero[-1]["end"].get("loadavg"),
    }


def step_scatter(t_step) -> float:
    """How far the steps scatter: half the 10th-to-90th percentile range over the median (0.05 = ±5%)."""
    v = np.asarray(t_step, dtype=float)
    v = v[np.isfinite(v)]
    if v.size < 2 or not np.median(v) > 0:
        return math.nan
    p10, p90 = np.percentile(v, [10, 90])
    return float((p90 - p10) / 2 / np.median(v))


def machine_state(run, t_step) -> dict:
    """busy (True, False, or None when the run recorded no machine counters), the figures of `machine_load` and
    `scatter` (step_scatter of the measured steps), and `line`: the state in one line of words."""
    load = machine_load(run)
    scatter = step_scatter(t_step)
    spread = f"steps within ±{scatter:.1%} of their median (10th to 90th percentile)" if scatter == scatter else ""
    if load is None:
        line = "machine: load not recorded for this run" + (f"; {spread}" if spread else "")
        return {"busy": None, "scatter": scatter, "line": line}
    busy = is_busy(load["other_cores"], load["steal"])
    la, lb = load.get("loadavg_start"), load.get("loadavg_end")
    facts = [
        f"other processes took {load['other_cores']:.2f} of {load['cores']} cores",
        f"CPU steal {load['steal']:.0%}",
    ]
    if la and lb:
        facts.append(f"load average {la[0]:g} -> {lb[0]:g}")
    if spread:
        facts.append(spread)
    line = f"machine: {'busy' if busy else 'quiet'} during the steps ({', '.join(facts)})"
    if busy:
        line += ": figures widened (intervals resample blocks of consecutive steps)"
    return {"busy": busy, "scatter": scatter, "line": line, **load}
