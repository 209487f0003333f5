"""How busy the machine is: what other processes take of its CPUs, read from Linux's /proc (pure, standard library).

Used on both sides of a run: a rank records a `snapshot` when its steps start and when they end (rank 0 adds the
machine's counters), `dtlab.results.busy` turns the two into the CPU time other processes took meanwhile, and
`dtlab doctor` samples the machine for a moment before a run (`sample`). The figures:

- other processes' CPU: the CPU time /proc/stat counts as busy (user, nice, system, irq, softirq), less the
  ranks' own CPU time (every thread of theirs, `time.process_time`), per second of wall time: cores' worth;
- CPU steal: time the hypervisor ran another guest while this one wanted the CPU (/proc/stat's 8th field,
  Linux >= 2.6.11), as a fraction of all CPU time;
- the load average (/proc/loadavg: runnable processes, averaged over 1, 5 and 15 minutes; the ranks count too).

On a machine without /proc (macOS) the counters are None and only the spread of the steps speaks.
"""

from __future__ import annotations

import os
import time

BUSY_OTHER_CORES = 0.25
"""Other processes taking this many cores' worth of CPU on average make the machine busy: on a CPU run every
core already has a rank, so what they take is taken from the ranks."""
BUSY_STEAL = 0.02
"""CPU steal above this fraction of the CPU time makes the machine busy."""
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_BUSY = ("user", "nice", "system", "irq", "softirq")


def cpu_counters(path: str = "/proc/stat") -> dict | None:
    """The machine's CPU time so far, in clock ticks, by kind (user, nice, system, idle, iowait, irq, softirq,
    steal; the kinds an old kernel lacks are 0), or None where there is no /proc/stat."""
    try:
        with open(path) as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    vals = [int(x) for x in first[1 : 1 + len(_FIELDS)]]
    return dict(zip(_FIELDS, vals + [0] * (len(_FIELDS) - len(vals))))


def load_average() -> list | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def snapshot(machine: bool) -> dict:
    """What a rank records at the start and at the end of its steps: the wall clock, this process's CPU time (s),
    and with `machine` the machine's CPU counters, clock ticks per second, core count and load average."""
    out = {"time": time.time(), "cpu_s": time.process_time()}
    if machine:
        out.update(
            stat=cpu_counters(),
            ticks=os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100,
            cores=os.cpu_count(),
            loadavg=load_average(),
        )
    return out


def between(start: dict, end: dict, own_cpu_s: float) -> dict:
    """Figures for the time between two machine snapshots, given the CPU seconds the ranks took meanwhile:
    wall_s, busy_s (all CPU time counted busy), other_s (busy_s less the ranks' own, at least 0), other_cores
    (other_s per second of wall time), steal (fraction of all CPU time); None values where /proc was missing."""
    wall = max(float(end["time"]) - float(start["time"]), 1e-9)
    a, b = start.get("stat"), end.get("stat")
    if not a or not b:
        return {"wall_s": wall, "busy_s": None, "other_s": None, "other_cores": None, "steal": None}
    tick = float(end.get("ticks") or 100)
    d = {k: max(int(b.get(k, 0)) - int(a.get(k, 0)), 0) for k in _FIELDS}
    busy = sum(d[k] for k in _BUSY) / tick
    total = sum(d.values()) / tick
    other = max(busy - own_cpu_s, 0.0)
    return {
        "wall_s": wall,
        "busy_s": busy,
        "other_s": other,
        "other_cores": other / wall,
        "steal": d["steal"] / tick / total if total > 0 else 0.0,
    }


def is_busy(other_cores: float | None, steal: float | None) -> bool:
    """True when other processes took BUSY_OTHER_CORES cores or more, or steal reached BUSY_STEAL."""
    return bool(
        (other_cores is not None and other_cores >= BUSY_OTHER_CORES) or (steal is not None and steal >= BUSY_STEAL)
    )


def sample(seconds: float = 0.5) -> dict:
    """The machine right now, over `seconds` (this process sleeps meanwhile, so its own CPU time is ~0):
    other_cores, steal, cores, loadavg and busy (True / False, None where /proc is missing)."""
    a = snapshot(machine=True)
    time.sleep(seconds)
    b = snapshot(machine=True)
    f = between(a, b, own_cpu_s=b["cpu_s"] - a["cpu_s"])
    busy = is_busy(f["other_cores"], f["steal"]) if f["other_cores"] is not None else None
    return {**f, "cores": b.get("cores"), "loadavg": b.get("loadavg"), "busy": busy}


def sample_words(s: dict) -> str:
    """One line for `sample`'s figures."""
    avg = f", load average {s['loadavg'][0]:g}" if s.get("loadavg") else ""
    if s.get("other_cores") is None:
        return f"machine load: not readable here (no /proc/stat){avg}"
    return (
        f"machine load: other processes are using {s['other_cores']:.2f} of {s.get('cores')} cores, "
        f"CPU steal {s['steal']:.0%}{avg} ({'busy' if s.get('busy') else 'quiet'})"
    )
