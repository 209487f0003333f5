"""How busy the machine is: what other processes take of its CPUs, read through psutil (pure: no torch).

Used on both sides of a run: a rank records a `snapshot` when its steps start and when they end (rank 0 adds the
machine's counters), `dtlab.results.busy` turns the two into the CPU time other processes took meanwhile, and
`dtlab doctor` samples the machine for a moment before a run (`sample`). The figures:

- other processes' CPU: the CPU time the kernel counts as busy (user, nice, system, irq, softirq), less the
  ranks' own CPU time (every thread of theirs, `time.process_time`), per second of wall time: cores' worth;
- CPU steal: time the hypervisor ran another guest while this one wanted the CPU (Linux >= 2.6.11 counts it; 0
  where the system does not), as a fraction of all CPU time;
- the load average (runnable processes, averaged over 1, 5 and 15 minutes; the ranks count too);
- the GPUs beside the CPUs (dtlab.config.nvml, where NVML can be read): each visible GPU's utilisation, memory and
  the processes on it; at a snapshot after the first, each process's share of kernel time since the one before.

The counters are kept in clock ticks, as Linux counts them (psutil's seconds times the tick rate): runs recorded
before psutil read them compare with runs after. Where the system gives no CPU times the counters are None and
only the spread of the steps speaks.
"""

from __future__ import annotations

import os
import time

import psutil

from dtlab.config.nvml import gpu_state

BUSY_OTHER_CORES = 0.25
"""Other processes taking this many cores' worth of CPU on average make the machine busy: on a CPU run every
core already has a rank, so what they take is taken from the ranks."""
BUSY_STEAL = 0.02
"""CPU steal above this fraction of the CPU time makes the machine busy."""
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_BUSY = ("user", "nice", "system", "irq", "softirq")


def cpu_counters() -> dict | None:
    """The machine's CPU time so far, in clock ticks, by kind (user, nice, system, idle, iowait, irq, softirq,
    steal; the kinds a system does not count are 0), or None where the system gives no CPU times."""
    try:
        t = psutil.cpu_times()
    except (OSError, RuntimeError, psutil.Error):
        return None
    tick = _tick()
    return {k: round(float(getattr(t, k, 0.0)) * tick) for k in _FIELDS}


def _tick() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def load_average() -> list | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    try:
        return [round(x, 2) for x in psutil.getloadavg()]
    except (OSError, RuntimeError):
        return None


_LAST_MACHINE: list[float] = []  # when this process last took a machine snapshot: the GPUs' samples start there


def snapshot(machine: bool) -> dict:
    """What a rank records at the start and at the end of its steps: the wall clock, this process's CPU time (s),
    and with `machine` the machine's CPU counters, clock ticks per second, core count, load average and GPUs (None
    where NVML cannot be read; per-process kernel time since this process's previous machine snapshot)."""
    out = {"time": time.time(), "cpu_s": time.process_time()}
    if machine:
        out.update(
            stat=cpu_counters(),
            ticks=_tick(),
            cores=os.cpu_count(),
            loadavg=load_average(),
            gpus=gpu_state(since=_LAST_MACHINE[-1] if _LAST_MACHINE else None),
        )
        _LAST_MACHINE.append(out["time"])
    return out


def between(start: dict, end: dict, own_cpu_s: float) -> dict:
    """Figures for the time between two machine snapshots, given the CPU seconds the ranks took meanwhile:
    wall_s, busy_s (all CPU time counted busy), other_s (busy_s less the ranks' own, at least 0), other_cores
    (other_s per second of wall time), steal (fraction of all CPU time); None values where there were no counters."""
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
    other_cores, steal, cores, loadavg, busy (True / False, None where the system gives no CPU times) and gpus (the
    GPUs NVML sees at its end, None without a driver)."""
    a = snapshot(machine=True)
    time.sleep(seconds)
    b = snapshot(machine=True)
    f = between(a, b, own_cpu_s=b["cpu_s"] - a["cpu_s"])
    busy = is_busy(f["other_cores"], f["steal"]) if f["other_cores"] is not None else None
    return {**f, "cores": b.get("cores"), "loadavg": b.get("loadavg"), "busy": busy, "gpus": b.get("gpus")}


def sample_words(s: dict) -> str:
    """One line for `sample`'s figures."""
    avg = f", load average {s['loadavg'][0]:g}" if s.get("loadavg") else ""
    if s.get("other_cores") is None:
        return f"machine load: not readable here (the system gives no CPU times){avg}"
    return (
        f"machine load: other processes are using {s['other_cores']:.2f} of {s.get('cores')} cores, "
        f"CPU steal {s['steal']:.0%}{avg} ({'busy' if s.get('busy') else 'quiet'})"
    )
