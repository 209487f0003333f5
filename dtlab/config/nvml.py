"""Who else is on the GPUs: NVIDIA's management library (NVML) through nvidia-ml-py (`pynvml`, pure Python: it
imports on a machine without a GPU, where `nvmlInit` then fails and every figure here is None). No torch, no CUDA.

- `gpu_state()`: each GPU the processes here may use (CUDA_VISIBLE_DEVICES, else all): index, UUID, name, its
  utilisation (NVML's sample over its last period, 1/6 s to 1 s by model: % of the time a kernel ran), memory used
  and total (bytes), and the processes on it (pid, GPU memory in bytes where NVML says, and with `since` the share of
  the time each one had a kernel running since then, where the GPU keeps per-process samples).
- `others(state, own_pids)`: the processes on each GPU that are not in `own_pids`.
- `owner(pid)`: the user and command line of a pid (psutil), for the words; `gpu_words(state, own_pids)`, and
  `gpu_lines` (the same with a warning after a GPU someone else is on: dtlab doctor, lab 00).

The machine's state beside the CPU's (dtlab.config.busy records it in a rank's snapshots, dtlab.results.busy reads
it), `dtlab doctor` and lab 00 use it; so does the live monitor's GPU panel.
"""

from __future__ import annotations

import os
import time

import psutil
import pynvml

from dtlab.units import fmt_bytes

nvml = pynvml  # the binding in use: tests put a fake module object with the same functions here


def _err() -> tuple:
    return (nvml.NVMLError, OSError, AttributeError)


def _visible(count: int) -> list:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's entries (indices or UUIDs) that NVML knows, else all."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    out: list = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            break
        if item.isdigit():
            if int(item) >= count:
                break  # CUDA stops at the first invalid entry
            out.append(int(item))
        else:
            out.append(item)
    return out


def _handle(which):
    if isinstance(which, int):
        return nvml.nvmlDeviceGetHandleByIndex(which)
    return nvml.nvmlDeviceGetHandleByUUID(which if which.startswith("GPU-") else f"GPU-{which}")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _processes(h, since: float | None) -> list[dict]:
    procs: dict[int, dict] = {}
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            found = getattr(nvml, fn)(h)
        except _err():
            continue
        for p in found:
            used = getattr(p, "usedGpuMemory", None)
            procs.setdefault(int(p.pid), {"pid": int(p.pid), "memory_bytes": int(used) if used else None})
    if since is not None:
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(h, int(since * 1e6))
        except _err():  # NVML_ERROR_NOT_FOUND: no sample since then; NOT_SUPPORTED on older GPUs
            samples = []
        sm: dict[int, list[float]] = {}
        for s in samples:
            sm.setdefault(int(s.pid), []).append(float(s.smUtil))
        for pid, xs in sm.items():
            procs.setdefault(pid, {"pid": pid, "memory_bytes": None})["sm_pct"] = sum(xs) / len(xs)
    return sorted(procs.values(), key=lambda p: p["pid"])


def gpu_state(since: float | None = None) -> list[dict] | None:
    """Each GPU visible here, as dicts (index, uuid, name, util_pct, memory_used_bytes, memory_total_bytes,
    processes, time), or None where NVML cannot be read (no NVIDIA driver: a CPU machine, a laptop). `since`
    (seconds since the epoch) adds each process's kernel time share since then (`sm_pct`), where NVML keeps it."""
    try:
        nvml.nvmlInit()
    except _err():
        return None
    try:
        count = nvml.nvmlDeviceGetCount()
        out = []
        for which in _visible(count):
            try:
                h = _handle(which)
                util = nvml.nvmlDeviceGetUtilizationRates(h)
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                out.append(
                    {
                        "index": nvml.nvmlDeviceGetIndex(h),
                        "uuid": _text(nvml.nvmlDeviceGetUUID(h)),
                        "name": _text(nvml.nvmlDeviceGetName(h)),
                        "util_pct": float(util.gpu),
                        "memory_used_bytes": int(mem.used),
                        "memory_total_bytes": int(mem.total),
                        "processes": _processes(h, since),
                        "time": time.time(),
                    }
                )
            except _err():
                continue
        return out
    except _err():
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except _err():
            pass


def others(state: list[dict] | None, own_pids) -> dict[int, list[dict]]:
    """{GPU index: the processes on it whose pid is not in `own_pids`}, GPUs with none left out."""
    own = {int(p) for p in own_pids}
    out = {}
    for g in state or []:
        rest = [p for p in g.get("processes", []) if p["pid"] not in own]
        if rest:
            out[g["index"]] = rest
    return out


def owner(pid: int) -> str:
    """'alice: python train.py' for a pid (its user and command line), or 'pid N' where it cannot be read (another
    user's process on some systems, or one in another pid namespace)."""
    try:
        p = psutil.Process(pid)
        argv = p.cmdline()
        # the program's name, not its folder: a long interpreter path would push the script off the line
        cmd = " ".join([os.path.basename(argv[0]), *argv[1:]] if argv else [])[:80] or p.name()
        return f"{p.username()}: {cmd} (pid {pid})"
    except (psutil.Error, OSError):
        return f"pid {pid}"


def process_words(p: dict) -> str:
    """One process on a GPU in words: who, its GPU memory, its kernel time share."""
    facts = [fmt_bytes(p["memory_bytes"])] if p.get("memory_bytes") else []
    if p.get("sm_pct") is not None:
        facts.append(f"kernels {p['sm_pct']:.0f}% of the time")
    return owner(p["pid"]) + (f", {', '.join(facts)}" if facts else "")


def gpu_words(state: list[dict] | None, own_pids=()) -> list[str]:
    """One line per GPU: name, utilisation, memory, and who else is on it (every process not in `own_pids`)."""
    if state is None:
        return ["GPUs: NVML not readable here (no NVIDIA driver), so nobody else's use of a GPU can be seen"]
    lines = []
    rest = others(state, own_pids)
    for g in state:
        head = (
            f"GPU {g['index']} ({g['name']}): {g['util_pct']:.0f}% busy, "
            f"{fmt_bytes(g['memory_used_bytes'])} of {fmt_bytes(g['memory_total_bytes'])} used"
        )
        who = rest.get(g["index"], [])
        tail = "; ".join(process_words(p) for p in who) if who else "nobody else on it"
        lines.append(f"{head}; {'shared with ' + tail if who else tail}")
    return lines


def gpu_lines(state: list | None, own_pids=()) -> list:
    """One line per GPU from NVML (dtlab.config.nvml): its utilisation, memory, and who else is on it (each process
    not in `own_pids`: its user, command line and GPU memory); a warning after a GPU someone else is on."""
    lines = gpu_words(state, own_pids)
    if others(state, own_pids):
        lines.append(
            "warning: another process is on a GPU: a run started now shares it, so its step times move with that "
            "process's kernels (the breakdown says so and widens its intervals)"
        )
    return lines
