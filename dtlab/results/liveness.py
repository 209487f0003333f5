"""Is the process that wrote a run's status still there? Pure (reads /proc only): no torch, no launching.

A run's status.json says "running" from the moment its launcher starts torchrun's agent until the launcher
writes an end state. A launcher that dies first (a kernel killed or restarted, a machine rebooted) writes none,
so a reader must check the processes themselves. PIDs are reused, so a process is identified by its PID *and*
its start time (field 22 of /proc/PID/stat, clock ticks since boot), on a host and a boot (the kernel's
boot_id): `identity(pid)` records that, `alive(ident)` checks it again later.
"""

from __future__ import annotations

import os
import socket


def boot_id() -> str | None:
    """This boot's id (changes at every reboot), None where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None if there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None


def identity(pid: int) -> dict:
    """What identifies process `pid` later: pid, start time, host and boot."""
    return {"pid": int(pid), "start_ticks": start_ticks(pid), "host": socket.gethostname(), "boot_id": boot_id()}


def alive(ident: dict | None) -> bool | None:
    """True if the process `ident` (from `identity`) still runs, False if it is gone (a zombie counts as gone),
    None when this machine cannot tell: recorded on another host, or nothing recorded."""
    if not isinstance(ident, dict) or not isinstance(ident.get("pid"), int) or isinstance(ident.get("pid"), bool):
        return None
    host, boot = ident.get("host"), ident.get("boot_id")
    if host is not None and host != socket.gethostname():
        return None
    if boot is not None and boot_id() is not None and boot != boot_id():
        return False  # this machine rebooted since: every process of that boot is gone
    if _state(ident["pid"]) in (None, "Z", "X"):
        return False
    ticks = ident.get("start_ticks")
    return ticks is None or start_ticks(ident["pid"]) == ticks


def _runs_for(pid: int, run_dir: str) -> bool:
    """True when process `pid` has `run_dir` (absolute) among its arguments: torchrun's agent of that run."""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            return os.path.abspath(run_dir).encode() in f.read()
    except OSError:
        return False


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
