"""How busy the machine was while a run's steps ran, from the `machine` events its ranks recorded (pure).

Every rank of a DDP run records its own CPU time when its steps start and when they end; rank 0 adds the machine's
counters (dtlab.config.busy). Other processes' CPU time is what the machine counted busy meanwhile, less what the
ranks on rank 0's host took themselves. The state is `busy` when other processes took at least
`BUSY_OTHER_CORES` cores' worth or CPU steal reached `BUSY_STEAL` (dtlab.config.busy); then the breakdown's
intervals resample blocks of consecutive steps (dtlab.results.spread) and the line says the figures were widened.

Rank 0's snapshots also hold the GPUs NVML saw (dtlab.config.nvml): a GPU is the run's when one of the ranks' pids
is on it. Another process on one of the run's GPUs that ran kernels during the steps (NVML's per-process samples),
or that was there at their end where the GPU keeps no samples, makes the GPU `shared`: the state is busy, labelled
with who it was, and the figures are widened as for a busy CPU. The GPUs' utilisation when the steps started and
when they ended is kept beside.
"""

from __future__ import annotations

import math

import numpy as np

from dtlab.config.busy import between, is_busy
from dtlab.config.nvml import others, process_words


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


def gpu_load(run) -> dict | None:
    """The run's GPUs while its steps ran, from rank 0's snapshots: {'gpus': [{index, name, util_start_pct,
    util_end_pct, others: [processes]}], 'shared': True when another process used one of them}; None when no GPU
    was recorded with a rank on it (a CPU run, NVML not readable, or ranks in another pid namespace than NVML's)."""
    snaps = {e.get("phase"): e for e in getattr(run, "machine", []) or [] if e.get("rank") == 0 and e.get("gpus")}
    if "start" not in snaps or "end" not in snaps:
        return None
    pids = set()
    if "pid" in run.ranks.columns:
        pids = {int(p) for p in run.ranks["pid"].dropna()}
    start = {g["index"]: g for g in snaps["start"]["gpus"]}
    gpus = []
    for g in snaps["end"]["gpus"]:
        seen = {p["pid"] for p in g.get("processes", [])} | {
            p["pid"] for p in start.get(g["index"], {}).get("processes", [])
        }
        if not seen & pids:
            continue  # none of the run's ranks on it
        sampled = any("sm_pct" in p for p in g.get("processes", []))
        rest = others([g], pids).get(g["index"], [])
        used = [p for p in rest if (p.get("sm_pct") or 0) > 0] if sampled else rest
        gpus.append(
            {
                "index": g["index"],
                "name": g.get("name"),
                "util_start_pct": start.get(g["index"], {}).get("util_pct"),
                "util_end_pct": g.get("util_pct"),
                "sampled": sampled,
                "others": used,
            }
        )
    if not gpus:
        return None
    return {"gpus": gpus, "shared": any(g["others"] for g in gpus)}


def gpu_line(load: dict) -> str:
    """The run's GPUs in words: shared with whom, or alone, with their utilisation at the start and end of the steps."""
    parts = []
    for g in load["gpus"]:
        util = f"{g['util_start_pct']:.0f}% -> {g['util_end_pct']:.0f}% busy" if g["util_start_pct"] is not None else ""
        if g["others"]:
            how = "" if g["sampled"] else " (on it at the end of the steps; this GPU keeps no per-process samples)"
            who = "; ".join(process_words(p) for p in g["others"])
            parts.append(f"GPU {g['index']} shared with {who}{how}" + (f" ({util})" if util else ""))
        else:
            parts.append(f"GPU {g['index']} alone" + (f" ({util})" if util else ""))
    return ", ".join(parts)


def machine_state(run, t_step) -> dict:
    """busy (True, False, or None when the run recorded no machine counters), the figures of `machine_load` and
    `scatter` (step_scatter of the measured steps), `gpu` (gpu_load, or None) and `line`: the state in one line of
    words. A GPU another process used while the steps ran makes the state busy, as a busy CPU does."""
    load = machine_load(run)
    gpu = gpu_load(run)
    scatter = step_scatter(t_step)
    spread = f"steps within ±{scatter:.1%} of their median (10th to 90th percentile)" if scatter == scatter else ""
    if load is None:
        line = "machine: load not recorded for this run" + (f"; {spread}" if spread else "")
        return {"busy": None, "scatter": scatter, "line": line, "gpu": gpu}
    cpu_busy = is_busy(load["other_cores"], load["steal"])
    shared = bool(gpu and gpu["shared"])
    busy = cpu_busy or shared
    la, lb = load.get("loadavg_start"), load.get("loadavg_end")
    facts = [
        f"other processes took {load['other_cores']:.2f} of {load['cores']} cores",
        f"CPU steal {load['steal']:.0%}",
    ]
    if la and lb:
        facts.append(f"load average {la[0]:g} -> {lb[0]:g}")
    if gpu:
        facts.append(gpu_line(gpu))
    if spread:
        facts.append(spread)
    state = "busy" if cpu_busy else "quiet"
    if shared:
        state = "GPU shared" if not cpu_busy else "busy, GPU shared"
    line = f"machine: {state} during the steps ({', '.join(facts)})"
    if busy:
        line += ": figures widened (intervals resample blocks of consecutive steps)"
    return {"busy": busy, "scatter": scatter, "line": line, "gpu": gpu, "gpu_shared": shared, **load}
