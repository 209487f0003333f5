"""Start torchrun from the notebook kernel and bring results back from disk.

The kernel never initialises CUDA and never forks itself into ranks: it starts `torchrun` as a subprocess
in a new session (so the whole group can be stopped together), follows rank 0's event file for progress,
and loads the run directory when the ranks are done. An interrupt, a timeout or a failing rank stops every
process; the ranks additionally die with torchrun (PR_SET_PDEATHSIG), so none is ever left behind.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time

from .config import RunConfig, dump_json
from .results import Run, RunFailed, load_run, read_events

_LIVE: "set[Handle]" = set()  # strong references: a handle dropped by the user must still be stopped at exit


def free_port() -> int:
    """A TCP port free on loopback right now (the OS picks it; no fixed rendezvous port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique_dir(parent: str, name: str) -> str:
    """parent/name-<timestamp>, with -2, -3, ... appended if two jobs start within the same second."""
    base = os.path.join(parent, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, k = base, 1
    while os.path.exists(path):
        k += 1
        path = f"{base}-{k}"
    return path


def default_out(cfg: RunConfig) -> str:
    return unique_dir("runs", f"{cfg.strategy}-{cfg.model}-p{cfg.nproc}-b{cfg.bucket_mb:g}")


class Handle:
    """A launched job: `status()`, `wait()`, `stop()`. Returned by `launch()`; `run()` waits on one."""

    def __init__(self, run_dir: str, proc: subprocess.Popen, nproc: int, total_steps: int, timeout_s: float,
                 desc: str, loader=load_run, unit: str = "step"):
        self.run_dir, self.proc, self.nproc = run_dir, proc, nproc
        self.total_steps, self.timeout_s, self.desc = total_steps, timeout_s, desc
        self.started = time.time()
        self._loader = loader
        self.unit = unit
        self._state = "running"
        self._offset, self._partial = 0, b""
        _LIVE.add(self)

    # ---- state ------------------------------------------------------------------------------------------
    def status(self) -> str:
        """'running', 'finished', 'failed', 'stopped' or 'timeout'."""
        if self._state == "running" and self.proc.poll() is not None:
            self._finish("finished" if self.proc.returncode == 0 else "failed")
        return self._state

    def _finish(self, state: str, **extra) -> None:
        self._state = state
        _LIVE.discard(self)
        _write_status(self.run_dir, state, returncode=self.proc.returncode, pid=self.proc.pid,
                      started=self.started, ended=time.time(), **extra)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process of the job: SIGTERM to torchrun's group, SIGKILL after `grace_s` seconds,
        then SIGKILL to any rank recorded in the run directory that is somehow still alive."""
        self.status()  # a job that already ended on its own keeps its real state
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in self.rank_pids():
            if _is_rank_of(pid, self.run_dir):  # never a reused PID that belongs to something else
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self._state == "running":
            self._finish("stopped")

    def rank_pids(self) -> list[int]:
        """PIDs the ranks recorded in their start events."""
        pids = []
        for r in range(self.nproc):
            p = os.path.join(self.run_dir, "events", f"rank{r}.jsonl")
            if os.path.exists(p):
                pids += [e["pid"] for e in read_events(p) if e.get("kind") == "start"]
        return pids

    # ---- waiting ----------------------------------------------------------------------------------------
    def wait(self, progress: bool = True, poll_s: float = 0.2):
        """Block until the job ends; show a progress bar with the live step time. Returns the loaded result.

        Raises RunFailed if a rank failed, the timeout passed, or the wait was interrupted (the job is
        stopped first in each case; KeyboardInterrupt is re-raised after stopping)."""
        bar = _bar(self.total_steps, self.desc, self.unit) if progress else None
        try:
            while self.status() == "running":
                self._follow(bar)
                if time.time() - self.started > self.timeout_s:
                    self.stop()
                    self._finish("timeout", error=f"timeout_s={self.timeout_s:g} s exceeded")
                    break
                time.sleep(poll_s)
            self._follow(bar)
        except KeyboardInterrupt:
            self.stop()
            self._finish("interrupted")
            raise
        finally:
            if bar is not None:
                bar.close()
        return self.result()

    def result(self):
        """The loaded run; raises RunFailed (with the partial run attached) unless it finished cleanly."""
        if self._state == "finished":
            return self._loader(self.run_dir)
        try:
            partial = self._loader(self.run_dir)
        except Exception:  # noqa: BLE001 - a failed job may not load; the events still name the cause
            partial = None
        raise _failure(self._state, self.run_dir, partial)

    def _follow(self, bar) -> None:
        """Read the new complete lines of rank 0's events to drive the progress bar."""
        if bar is None:
            return
        path = os.path.join(self.run_dir, "events", "rank0.jsonl")
        if not os.path.exists(path):
            return
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = self._partial + f.read()
            self._offset = f.tell()
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            kind = ev.get("kind")
            if kind in ("step", "baseline_step", "calib"):
                bar.update(1)
            if kind in ("step", "baseline_step"):
                bar.set_postfix_str(f"{'baseline ' if kind == 'baseline_step' else ''}"
                                    f"step {ev['t_step'] * 1e3:.0f} ms")
            elif kind == "calib":
                bar.set_postfix_str(f"round {ev['round'] + 1} of {ev['rounds']} done")
            elif kind == "ready":
                bar.set_postfix_str("model built, training")


def _failure(state: str, run_dir: str, run) -> RunFailed:
    import glob
    errors = sorted((e for p in glob.glob(os.path.join(run_dir, "events", "rank*.jsonl"))
                     for e in read_events(p) if e.get("kind") == "error"), key=lambda e: e.get("time", 0))
    if errors:  # the earliest error is the cause; later ones are peers losing their connection
        e = errors[0]
        tail = "\n".join(e.get("traceback", "").strip().splitlines()[-12:])
        return RunFailed(f"rank {e['rank']} failed: {e['error']}\n{tail}\n(run directory: {run_dir})",
                         rank=e["rank"], error=e["error"], traceback_tail=tail, run_dir=run_dir, run=run)
    log = os.path.join(run_dir, "logs", "torchrun.log")
    tail = ""
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            tail = "\n".join(f.read().strip().splitlines()[-12:])
    return RunFailed(f"run {state}: no rank recorded an error; torchrun log tail:\n{tail}\n"
                     f"(run directory: {run_dir})", error=state, traceback_tail=tail, run_dir=run_dir, run=run)


def start_torchrun(run_dir: str, nproc: int, module: str, gloo_threads: bool) -> subprocess.Popen:
    """Start `torchrun -m MODULE RUN_DIR` in its own session on a free loopback port."""
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    if gloo_threads and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the cores: give each its share instead of torchrun's default of 1 thread.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # The package must be importable by the ranks even when the kernel found it through sys.path alone.
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # torchrun is started through a two-line shim that asks Linux to SIGTERM it when this process dies (a
    # kernel killed outright runs no atexit handler); torchrun then stops its ranks, which also die with it.
    shim = ("import ctypes, os, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM); "
            "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.executable, [sys.executable] + sys.argv[2:])")
    cmd = [sys.executable, "-c", shim, str(os.getpid()), "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0", "-m", module,
           os.path.abspath(run_dir)]
    log = open(os.path.join(run_dir, "logs", "torchrun.log"), "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    log.close()
    return proc


def prepare_dir(out: str) -> str:
    """Create the run directory; refuse one that already holds a run."""
    if os.path.exists(os.path.join(out, "config.json")):
        raise ValueError(f"out: {out!r} already holds a run; choose a new directory (runs are never overwritten)")
    os.makedirs(os.path.join(out, "events"), exist_ok=True)
    return out


def launch(config: RunConfig) -> Handle:
    """Validate `config`, write the run directory and start the ranks; return at once with a `Handle`."""
    cfg = config.validate()
    out = prepare_dir(cfg.out or default_out(cfg))
    cfg = cfg.replace(out=out) if cfg.out != out else cfg
    backend = cfg.resolved_backend()
    dump_json({"config": cfg.to_dict(), "launch": {"time": time.time(), "python": sys.executable,
                                                   "backend": backend}}, os.path.join(out, "config.json"))
    proc = start_torchrun(out, cfg.nproc, "dtlab.worker", gloo_threads=backend == "gloo")
    _write_status(out, "running", pid=proc.pid, started=time.time())
    desc = f"{cfg.strategy} {cfg.model} x{cfg.nproc} ({backend})"
    return Handle(out, proc, cfg.nproc, cfg.steps + cfg.baseline_steps, cfg.timeout_s, desc)


def run(config: RunConfig, progress: bool = True) -> Run:
    """Launch and wait: the run's `Run` on success; `RunFailed` (with the partial run) otherwise."""
    return launch(config).wait(progress=progress)


def _write_status(run_dir: str, state: str, **fields) -> None:
    dump_json({"state": state, **fields}, os.path.join(run_dir, "status.json"))


def _is_rank_of(pid: int, run_dir: str) -> bool:
    """True if `pid` is alive and is a rank started for `run_dir` (its command line names the directory)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.path.abspath(run_dir).encode() in f.read()
    except OSError:
        return False


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(os.getpgid(pid), sig)
    except (ProcessLookupError, PermissionError):
        pass


def _bar(total: int, desc: str, unit: str = "step"):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit=unit)


@atexit.register
def _stop_all() -> None:
    """No run outlives the Python process that started it."""
    for h in list(_LIVE):
        if h.proc.poll() is None:
            h.stop(grace_s=3.0)
