"""One run per GPU on a shared node, when an instructor turns it on: `DTLAB_GPU_LOCK_DIR` names a folder every user
can write (e.g. `install -d -m 1777 /var/lock/dtlab-gpus`), and a run that uses GPUs takes a lock file per GPU there
(`gpu-<NVML UUID>.lock`, or the GPU's index where NVML cannot be read) before its ranks start. A second run that
wants a held GPU waits, saying for whom and since when, then runs.

The locks are `flock` locks, held by the launching process (a notebook kernel, the `dtlab` command) from before its
ranks start until its Handle records the run's end: the kernel releases them when it exits or crashes, so a lock is
never left behind by a process that is gone. Each lock file holds its holder's user, host, pid, run directory and
start time, for the waiting run's message. GPUs are taken in sorted order, so two runs that want the same two GPUs
never each hold one and wait for the other.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import logging
import os
import socket
import time

from dtlab.config.nvml import gpu_state

ENV = "DTLAB_GPU_LOCK_DIR"
SAY_EVERY_S = 60.0  # a waiting run says again who holds the GPU this often
_LOG = logging.getLogger(__name__)


def lock_dir(environ=os.environ) -> str | None:
    """The lock folder when the per-GPU lock is on, else None. ValueError naming the variable when it is set to a
    folder that does not exist or that this user cannot write."""
    d = environ.get(ENV)
    if not d:
        return None
    if not os.path.isdir(d) or not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(
            f"{ENV}={d!r} must be an existing folder every user of the node can write (e.g. created with "
            "`install -d -m 1777 DIR`), or unset to turn the per-GPU lock off"
        )
    return d


def gpu_names(n: int, environ=os.environ) -> list[str]:
    """Lock names of the first `n` GPUs this process's ranks see (CUDA's order): NVML's UUID of each, else the
    entry of CUDA_VISIBLE_DEVICES, else the index."""
    state = gpu_state()
    if state:
        return [f"gpu-{g['uuid']}" for g in state[:n]]
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    items = [s.strip() for s in spec.split(",") if s.strip()] if spec else [str(i) for i in range(n)]
    return [f"gpu-{s}" for s in items[:n]]


class GpuLocks:
    """The GPU locks a run holds; `release()` (safe to call twice) lets the next run have them."""

    def __init__(self, held: list[tuple[str, int]]):
        self.held = held

    @property
    def names(self) -> list[str]:
        """The GPUs held, by lock name."""
        return [n for n, _ in self.held]

    def release(self) -> None:
        """Empty each lock file and unlock it."""
        for _, fd in self.held:
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self.held = []


def _holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 65536) or b"{}")
    except (OSError, ValueError):
        return {}


def waiting_words(name: str, holder: dict, now: float) -> str:
    """'dtlab: gpu-X is in use by alice's run runs/ddp (pid 12, host h) since 10:02:03, 75 s ago; waiting ...'."""
    since = holder.get("since")
    when = (
        f" since {time.strftime('%H:%M:%S', time.localtime(since))}, {now - since:.0f} s ago"
        if isinstance(since, (int, float))
        else ""
    )
    who = f"{holder.get('user', 'someone')}'s run {holder.get('run_dir', '?')} (pid {holder.get('pid', '?')}"
    who += f", host {holder['host']})" if holder.get("host") else ")"
    return f"dtlab: {name} is in use by {who}{when}; waiting for it to end (one run per GPU: {ENV})"


def acquire(names: list[str], directory: str, run_dir: str, poll_s: float = 0.5) -> GpuLocks:
    """Lock every GPU in `names` (sorted order) under `directory`, waiting for each held one and saying for whom and
    since when (logging.getLogger('dtlab'), again every SAY_EVERY_S seconds); then record this run as the holder."""
    held: list[tuple[str, int]] = []
    fd = -1
    try:
        for name in sorted(set(names)):
            fd = os.open(os.path.join(directory, f"{name}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
            try:
                os.fchmod(fd, 0o666)  # the next user must be able to open it too (only its creator may chmod)
            except OSError:
                pass
            said = None
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    now = time.time()
                    if said is None or now - said >= SAY_EVERY_S:
                        _LOG.warning(waiting_words(name, _holder(fd), now))
                        said = now
                    time.sleep(poll_s)
            held.append((name, fd))
            fd = -1
            me = {
                "user": getpass.getuser(),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "run_dir": os.path.abspath(run_dir),
                "since": time.time(),
            }
            os.ftruncate(held[-1][1], 0)
            os.pwrite(held[-1][1], json.dumps(me).encode(), 0)
            if said is not None:
                _LOG.warning(f"dtlab: {name} is free now; this run takes it")
    except BaseException:  # an interrupt while waiting: let go of what was taken, leave the holder's file alone
        if fd >= 0:
            os.close(fd)
        GpuLocks(held).release()
        raise
    return GpuLocks(held)


def run_locks(backend: str, nproc: int, ngpu: int, run_dir: str, environ=os.environ) -> GpuLocks | None:
    """The locks of the GPUs a run will use (an NCCL run's first min(nproc, ngpu) GPUs), taken when the per-GPU
    lock is on (ENV set), waiting for them; None otherwise (the lock off, or a CPU run)."""
    directory = lock_dir(environ)
    if directory is None or backend != "nccl" or ngpu < 1:
        return None
    return acquire(gpu_names(min(nproc, ngpu), environ), directory, run_dir)
