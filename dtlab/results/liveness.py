"""Is the process that wrote a run's status still there? Pure (psutil only): no torch, no launching.

A run's status.json says "running" from the moment its launcher starts torchrun's agent until the launcher
writes an end state. A launcher that dies first (a kernel killed or restarted, a machine rebooted) writes none,
so a reader must check the processes themselves. PIDs are reused, so a process is identified by its PID *and*
its start time (clock ticks since boot, as Linux counts them in field 22 of /proc/PID/stat), on a host and a boot:
`identity(pid)` records that, `alive(ident)` checks it again later. psutil reads them (Linux and macOS alike): the
start time is its create time less its boot time, both on the wall clock, so a clock set while the process runs
moves both and not their difference. A boot is told by its boot time: one that moved by more than REBOOT_S is
another boot (a clock step that large also reads as one; the pid and start time still decide for a live process on
a machine whose boot time did not move). Statuses written before carry the kernel's `boot_id` as well, which is
not compared: the pid and start time decide for them.
"""

from __future__ import annotations

import os
import socket

import psutil

REBOOT_S = 30.0
"""A boot time that moved by more than this many seconds is another boot."""


def _tick() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def boot_time() -> float | None:
    """When this machine booted (seconds since the epoch), None where the system does not say."""
    try:
        return psutil.boot_time()
    except (OSError, RuntimeError, psutil.Error):
        return None


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None if there is no such process (or no boot time here)."""
    try:
        created = psutil.Process(int(pid)).create_time()
    except (psutil.Error, OSError, ValueError):
        return None
    booted = boot_time()
    return None if booted is None else round((created - booted) * _tick())


def process_state(pid: int | None) -> str | None:
    """psutil's status of process `pid` ('running', 'sleeping', 'stopped', 'zombie', ...), None if there is none."""
    if pid is None:
        return None
    try:
        return psutil.Process(int(pid)).status()
    except (psutil.Error, OSError, ValueError):
        return None


def identity(pid: int) -> dict:
    """What identifies process `pid` later: pid, start time, host and boot time."""
    return {"pid": int(pid), "start_ticks": start_ticks(pid), "host": socket.gethostname(), "boot_time": boot_time()}


def alive(ident: dict | None) -> bool | None:
    """True if the process `ident` (from `identity`) still runs, False if it is gone (a zombie counts as gone),
    None when this machine cannot tell: recorded on another host, or nothing recorded."""
    if not isinstance(ident, dict) or not isinstance(ident.get("pid"), int) or isinstance(ident.get("pid"), bool):
        return None
    host, boot, now = ident.get("host"), ident.get("boot_time"), boot_time()
    if host is not None and host != socket.gethostname():
        return None
    if isinstance(boot, (int, float)) and now is not None and abs(boot - now) > REBOOT_S:
        return False  # this machine rebooted since: every process of that boot is gone
    if process_state(ident["pid"]) in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return False
    ticks = ident.get("start_ticks")
    return ticks is None or start_ticks(ident["pid"]) == ticks


def _runs_for(pid: int, run_dir: str) -> bool:
    """True when process `pid` has `run_dir` (absolute) in its arguments (a file in it counts): torchrun's agent of
    that run."""
    try:
        argv = psutil.Process(int(pid)).cmdline()
    except (psutil.Error, OSError, ValueError):
        return False
    return any(os.path.abspath(run_dir) in a for a in argv)


def running_state(status: dict, run_dir: str | None = None) -> dict | None:
    """For a status that says 'running': None while its agent runs (or this machine cannot tell, see `alive`);
    otherwise what a reader should report instead, as {'state': 'abandoned', 'why': sentence} when the launcher
    is gone too (or unknown), or {'note': sentence} when the launcher still runs (it records the end itself on
    its next poll: the Handle's status() or wait()).

    The launcher is the Python process that called launch (a notebook kernel); the agent is torchrun's, which
    stops its ranks and exits when the launcher dies: the run is over once the agent is gone (its ranks die with
    it). Statuses written before identities were recorded carry only the agent's pid: without a start time, a
    live pid counts only when its command line names `run_dir` (the agent's does), so a reused pid does not."""
    agent = status.get("agent") or ({"pid": status["pid"]} if isinstance(status.get("pid"), int) else None)
    launcher = status.get("launcher")
    state = alive(agent)
    if state and "agent" not in status and run_dir is not None and not _runs_for(agent["pid"], run_dir):
        state = False
    if state is not False:
        return None
    gone = f"its torchrun agent (pid {agent['pid']}) is gone and no end state was recorded"
    if alive(launcher):
        return {
            "note": f"{gone}; its launcher (pid {launcher['pid']}) still runs and records the end when it next "
            "polls (the Handle's status() or wait())"
        }
    who = f"the process that launched it (pid {launcher['pid']}) is gone, " if isinstance(launcher, dict) else ""
    return {"state": "abandoned", "why": f"{who}{gone}: a kernel that crashed or was restarted, or a reboot"}
