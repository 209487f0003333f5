"""A launched job and the two ways to start one: `launch()` returns a Handle at once, `run()` waits on it.

- `Handle`: `status()`, `wait()` (progress bar, timeout, the stall watchdog of dtlab.launching.watchdog, and
  RunFailed from dtlab.launching.failures when the run did not finish), `stop()`, `result()`, `rank_pids()`.
  Every rank PID of the run is gone before `wait()` or `stop()` returns. On one node of a multi-node job
  (dtlab.config.nodes) a Handle watches, stops and reports that node's ranks (found by their slot); its failure
  report still names a culprit on another node, from the files that node's launcher left in the shared run directory.
- `_LIVE` and `_stop_all`: every running handle is stopped when the Python process exits (registered with atexit
  once, when this module is first imported).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time

import psutil

from dtlab.config.placement import device_count
from dtlab.config.run import RunConfig
from dtlab.config.strategies import strategy_spec
from dtlab.launching import replay
from dtlab.launching.failures import crashed_after_done, run_failure
from dtlab.launching.gpulock import run_locks
from dtlab.launching.nodes import NodeLaunch, NodeSpec, start_job, wait_for_nodes
from dtlab.launching.torchrun import (
    default_out,
    is_rank_of,
    rank_processes,
    release_lifeline,
    signal_group,
    signal_process,
)
from dtlab.launching.watchdog import RankFeed, StallWatch
from dtlab.results.events import read_events
from dtlab.results.run import Run, load_run
from dtlab.runfiles import DiskFull, disk_sentence, dump_json, looks_full

_LOG = logging.getLogger(__name__)

_LIVE: set[Handle] = set()  # strong references: a handle dropped by the user must still be stopped at exit
TINY_STARTUP_S = 120.0
"""Silence allowed to a rank of the tiny model before its first step (no download, nothing big to build): the
slowest of 1,666 launches of every strategy at 2 to 4 ranks, side by side beside a CPU hog on 2 busy cores, took
33.6 s from the launch call to every rank's first step (benchmarks/launch_stress.py, docs/benchmarks.md). A rank
silent longer is caught by the stall rule, with every rank's stacks, before a run's timeout (300 s for `tiny()`)."""
PEER_WAIT_S = 15.0  # how long a node waits for the other nodes' reports before naming a culprit or loading


class Handle(StallWatch):
    """A launched job: `status()`, `wait()`, `stop()`. Returned by `launch()`; `run()` waits on one."""

    def __init__(
        self,
        run_dir: str,
        proc: subprocess.Popen,
        nproc: int,
        total_steps: int,
        timeout_s: float,
        desc: str,
        loader=load_run,
        unit: str = "step",
        stall_s: float | None = None,
        node: NodeLaunch | None = None,
        max_restarts: int = 0,
    ):
        self.run_dir, self.proc, self.nproc = run_dir, proc, nproc
        self.node = node or NodeLaunch(run_dir, nproc)
        self.total_steps, self.timeout_s, self.desc = total_steps, timeout_s, desc
        self.stall_s, self.max_restarts = stall_s, max_restarts
        self.started = time.time()
        self._t0 = time.monotonic()
        self._loader = loader
        self.unit = unit
        self._state = "running"
        self._stall: dict | None = None
        self._feeds = (
            []
            if self.node.multi
            else [RankFeed(r, os.path.join(run_dir, "events", f"rank{r}.jsonl"), self._t0) for r in range(nproc)]
        )
        self._foreign: set[str] = set()  # event files of other nodes' ranks
        self._disk: DiskFull | None = None  # set when the run's end state could not be written: disk full
        _LIVE.add(self)

    def _discover(self) -> None:
        """Multi-node: add a feed for every rank of this node that has written its start event (global ranks
        are known only after the rendezvous; a rank's slot says which launcher started it)."""
        if not self.node.multi or len(self._feeds) >= self.nproc:
            return
        known = {f.path for f in self._feeds} | self._foreign
        for name in sorted(os.listdir(os.path.join(self.run_dir, "events"))):
            path = os.path.join(self.run_dir, "events", name)
            if path in known or not name.endswith(".jsonl"):
                continue
            start = next(iter(read_events(path)), None)
            if start is None:  # opened, first line not written yet
                continue
            if start.get("slot") == self.node.slot:
                self._feeds.append(RankFeed(start["rank"], path, self._t0))
                self._feeds.sort(key=lambda f: f.rank)
            else:
                self._foreign.add(path)

    def stall_threshold(self, stepping: bool) -> float:
        """The watchdog's allowance (dtlab.launching.watchdog), with TINY_STARTUP_S before the first step of a run
        of the tiny model."""
        startup = getattr(self, "startup_s", None)
        if not stepping and startup is not None:
            return max(self.stall_s or 0.0, startup)
        return super().stall_threshold(stepping)

    # ---- state ------------------------------------------------------------------------------------------
    def status(self) -> str:
        """'running', 'finished', 'failed', 'stalled', 'stopped', 'timeout' or 'interrupted'."""
        if self._state == "running" and self.proc.poll() is not None:
            if self.proc.returncode == 0:
                self._finish("finished")
            else:
                ranks = [f.rank for f in self._feeds] if self.node.multi else list(range(self.nproc))
                late = crashed_after_done(self.run_dir, ranks) if len(ranks) == self.nproc else None
                if late:  # every rank recorded `done`: the results are whole, only the shutdown crashed
                    _LOG.warning(f"dtlab: {late} Every rank had recorded `done`, so the run's results are complete.")
                    self._finish("finished", shutdown_crash=late)
                else:
                    self._finish("failed")
        return self._state

    def _finish(self, state: str, **extra) -> None:
        self._state = state
        _LIVE.discard(self)
        release_lifeline(self.proc)
        if getattr(self, "gpu_locks", None) is not None:  # the next run on these GPUs may start
            self.gpu_locks.release()
        if (
            self.max_restarts
        ):  # how often torchrun restarted the group (dtlab.results.restarts), from every event written
            self._follow(None)
            extra.setdefault("restarts", max((f.attempt for f in self._feeds), default=0))
        if looks_full(self.run_dir):
            extra["disk"] = disk_sentence(self.run_dir)
        try:
            dump_json(
                {
                    "state": state,
                    "returncode": self.proc.returncode,
                    "pid": self.proc.pid,
                    "started": self.started,
                    "ended": time.time(),
                    **extra,
                },
                self.node.path("status"),
            )
        except DiskFull as e:  # status.json keeps its last state; result() raises RunFailed naming the disk
            self._disk = e

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process of the job and return once every rank PID of the run is gone: SIGTERM to
        torchrun's group (SIGCONT to the ranks, so a frozen one can act on it), SIGKILL after `grace_s`
        seconds, then SIGKILL to any rank of this run still alive."""
        self.status()  # a job that already ended on its own keeps its real state
        self._terminate(grace_s)
        if self._state == "running":
            self._finish("stopped")

    def _end(self, state: str, **extra) -> None:
        self._terminate()
        self._finish(state, **extra)

    def _terminate(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGTERM)
            for p in self.live_ranks():
                signal_process(p, signal.SIGCONT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        release_lifeline(self.proc)
        deadline = time.monotonic() + 10.0
        while True:  # the ranks die with torchrun (PDEATHSIG); make sure before returning
            live = self.live_ranks()
            left = deadline - time.monotonic()
            if not live or left <= 0:
                break
            for p in live:
                signal_process(p, signal.SIGKILL)
            psutil.wait_procs(live, timeout=min(left, 1.0))

    def rank_pids(self) -> list[int]:
        """PIDs this node's ranks recorded in their start events."""
        self._discover()
        pids = []
        for p in [f.path for f in self._feeds]:
            if os.path.exists(p):
                pids += [e["pid"] for e in read_events(p) if e.get("kind") == "start" and e.get("pid")]
        return pids

    def live_ranks(self) -> list[psutil.Process]:
        """Rank processes of this run still alive, as psutil processes (pid and start time, so a signal through one
        never reaches a process that reused its pid): the recorded PIDs, plus any process started for this run
        directory that had not recorded itself yet (a rank still importing torch)."""
        slot = self.node.slot
        found = {p.pid: p for p in rank_processes(self.run_dir, slot)}
        for pid in set(self.rank_pids()) - set(found):
            try:
                found[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
        return [found[pid] for pid in sorted(found) if is_rank_of(pid, self.run_dir, slot)]

    def live_rank_pids(self) -> list[int]:
        """PIDs of `live_ranks`."""
        return [p.pid for p in self.live_ranks()]

    # ---- waiting ----------------------------------------------------------------------------------------
    def wait(self, progress: bool = True, poll_s: float = 0.2, on_poll=None):
        """Block until the job ends; show a progress bar with the live step time. Returns the loaded result.
        `on_poll`: called with no argument at every poll and once more when the job has ended (a live monitor,
        dtlab.viz.monitor: it reads the event files in this process, so the ranks pay nothing for it).

        Raises RunFailed if a rank failed, a rank stalled (the watchdog, see `RunConfig.stall_s`), the timeout
        passed, or the wait was interrupted (the job is stopped first in each case; KeyboardInterrupt is
        re-raised after stopping). Every rank PID of the run is gone when this returns or raises."""
        bar = _bar(self.total_steps, self.desc, self.unit) if progress else None
        try:
            while self.status() == "running":
                self._follow(bar)
                if time.time() - self.started > self.timeout_s:
                    self._on_timeout(self.timeout_s)
                    break
                stalled = self._watch(bar)
                if stalled:
                    self._on_stall(stalled)
                    break
                if on_poll is not None:
                    on_poll()
                time.sleep(poll_s)
            self._follow(bar)
            if on_poll is not None:
                on_poll()
        except KeyboardInterrupt:
            self._end("interrupted")
            raise
        finally:
            if bar is not None:
                bar.close()
        if self._state != "finished":
            self._terminate()  # torchrun stopped its ranks when one failed: check that none is left
        return self.result()

    def result(self):
        """The loaded run; raises RunFailed (with the partial run attached) unless it finished cleanly."""
        if self.node.multi and not os.path.exists(self.node.path("rendezvous")):
            wait_for_nodes(self.run_dir, PEER_WAIT_S)  # the other nodes' reports complete the run (or name a culprit)
        if self._state == "finished" and self._disk is None:
            return self._loader(self.run_dir)
        try:
            partial = self._loader(self.run_dir)
        except Exception:  # noqa: BLE001 - a failed job may not load; the events still name the cause
            partial = None
        state = "failed" if self._state == "finished" else self._state  # finished, but its record is not whole
        raise run_failure(state, self.run_dir, partial, self._stall, node=self.node, disk=self._disk)

    def _follow(self, bar) -> None:
        """Read the new complete lines of every rank's events; rank 0's drive the progress bar."""
        now = time.monotonic()
        self._discover()
        for feed in self._feeds:
            events = feed.read(now)
            if bar is None or feed is not self._feeds[0]:
                continue
            for ev in events:
                kind = ev.get("kind")
                if kind in ("step", "baseline_step", "calib", "update"):
                    bar.update(1)
                if kind in ("step", "baseline_step"):
                    bar.set_postfix_str(
                        f"{'baseline ' if kind == 'baseline_step' else ''}step {ev['t_step'] * 1e3:.0f} ms"
                    )
                elif kind == "calib":
                    bar.set_postfix_str(f"round {ev['round'] + 1} of {ev['rounds']} done")
                elif kind == "update":  # the asynchronous server's rank 0: one per pushed gradient
                    bar.set_postfix_str(f"version {ev.get('version')}, staleness {ev.get('staleness')}")
                elif kind == "ready":
                    bar.set_postfix_str("model built, training")
                elif kind == "restart":  # torchrun restarted the group: the bar goes back to the resumed step
                    bar.n = int(ev.get("resumed_from") or 0)
                    bar.set_postfix_str(f"restart {ev.get('attempt')}: resumed from step {bar.n}")


def launch(config: RunConfig, node: NodeSpec | None = None) -> Handle:
    """Validate `config` (fields, data file, machine), write the run directory and start the ranks; return
    at once with a `Handle`. Nothing is created or started when validation fails. When grading a submission
    (DTLAB_REPLAY, see dtlab.launching.replay), returns its recorded run instead, or raises ReplayMissing.

    With `nnodes` > 1 this starts this node's part of the job (see dtlab.config.nodes): call it on every node with
    the same config; `node` says how to start this node's agent where the defaults do not fit
    (dtlab.launching.emulate)."""
    if replay.replay_root():  # grading a submission: load its recorded run, on whatever machine grades it
        return replay.Replayed(replay.require("config", config.to_dict(), type(config)().to_dict()), load_run)
    cfg = config.validate()
    out = os.path.abspath(cfg.out) if cfg.nnodes > 1 else (cfg.out or default_out(cfg))
    cfg = cfg.replace(out=out) if cfg.out != out else cfg
    backend = cfg.resolved_backend()
    facts = {"time": time.time(), "python": sys.executable, "backend": backend, **launch_facts()}
    locks = run_locks(backend, cfg.nproc, device_count(), out)  # one run per GPU, when DTLAB_GPU_LOCK_DIR is set
    try:
        nl, proc = start_job(cfg, "config", cfg.to_dict(), facts, "dtlab.rank.worker", backend == "gloo", node)
    except BaseException:
        if locks is not None:
            locks.release()
        raise
    desc = f"{cfg.strategy} {cfg.model} x{cfg.nproc} ({backend})"
    if nl.multi:
        desc += f" node {nl.slot + 1} of {nl.nnodes}"
    spec = strategy_spec(cfg.strategy)  # an asynchronous server (rank 0) takes one update per worker step
    total = cfg.steps * (cfg.nproc * cfg.nnodes - spec.server_ranks) if spec.asynchronous else cfg.steps
    h = Handle(
        nl.run_dir,
        proc,
        cfg.nproc,
        total + cfg.measurement.baseline_steps,
        cfg.timeout_s,
        desc,
        stall_s=cfg.stall_s,
        node=nl,
        max_restarts=cfg.restarts.max_restarts,
    )
    h.gpu_locks = locks
    h.startup_s = TINY_STARTUP_S if cfg.model == "tiny" else None
    return h


def launch_facts() -> dict:
    """What a replay needs to rebuild a lab's configs on another machine: quick mode and the GPU count."""
    return {"quick": os.environ.get("DTLAB_QUICK", "0") == "1", "gpus": device_count()}


def run(config: RunConfig, progress: bool = True) -> Run:
    """Launch and wait: the run's `Run` on success; `RunFailed` (with the partial run) otherwise."""
    return launch(config).wait(progress=progress)


def _bar(total: int, desc: str, unit: str = "step"):
    # tqdm.auto imports IPython and ipywidgets where present (heavy): only when a bar is drawn, not with the module
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit)


@atexit.register
def _stop_all() -> None:
    """No run outlives the Python process that started it."""
    for h in list(_LIVE):
        if h.proc.poll() is None:
            h.stop(grace_s=3.0)
