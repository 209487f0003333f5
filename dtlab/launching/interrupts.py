"""Interruptions at random moments, for lab 12 (what does it cost?): a spot instance is taken away at moments
nobody chooses. dtlab.rank's fault injection (DTLAB_FAULT) kills one rank once, at the start of a step;
`interrupted_run` kills ranks from outside instead, as a provider does: it launches the run (dtlab.launch), follows
the ranks' event files while it waits, and sends SIGKILL to one rank (seeded random) once the attempt has trained
for a seeded random time, `kills` times at most. The times are independent exponential draws with mean
`mean_gap_s`: a Poisson process of interruptions, its clock running while the group trains (not while it
restarts). torchrun restarts the group from the newest complete checkpoint (`max_restarts` must exceed `kills`).
`count_line` says why a run had the kills it had, from its records.
"""

from __future__ import annotations

import glob
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np

from dtlab.launching.handle import launch
from dtlab.launching.torchrun import is_rank_of
from dtlab.results.events import RankTail, file_rank
from dtlab.units import fmt_time


@dataclass
class Interrupter:
    """Kills one rank of `run_dir`'s group after each attempt has trained for `gaps[i]` seconds (attempt i: the
    first, then each restart), `ranks[i]` the rank; called at every poll of Handle.wait. `log`: one dict per kill
    (attempt, rank, pid, gap_s, time: the kill's wall time, s since the epoch, step: the last step recorded)."""

    run_dir: str
    gaps: list
    ranks: list
    steps: int
    log: list = field(default_factory=list)
    _tails: dict = field(default_factory=dict)  # path -> its RankTail (dtlab.results.events)
    _trained_from: dict = field(default_factory=dict)  # attempt -> monotonic time its training was first seen
    _pids: dict = field(default_factory=dict)  # (attempt, rank) -> pid
    _last_step: dict = field(default_factory=dict)  # attempt -> last step recorded

    def _read(self) -> None:
        """New events of every rank's event file, each followed by a RankTail: the rules for torn and damaged
        lines (a line torn by a kill, an event of the wrong schema or rank) every reader of event files applies."""
        for path in sorted(glob.glob(os.path.join(self.run_dir, "events", "rank*.jsonl"))):
            if file_rank(path) is not None and path not in self._tails:
                self._tails[path] = RankTail(path)
        for tail in self._tails.values():
            for ev in tail.read():
                self._see(ev)

    def _see(self, ev: dict) -> None:
        a, k = int(ev.get("attempt") or 0), ev.get("kind")
        if k == "start" and ev.get("pid"):
            self._pids[(a, int(ev["rank"]))] = int(ev["pid"])
        elif k == "step" or (k == "restart" and a > 0):
            self._trained_from.setdefault(a, time.monotonic())
            if k == "step":
                self._last_step[a] = max(self._last_step.get(a, -1), int(ev["step"]))

    def poll(self) -> None:
        """Kill the next rank when its attempt has trained long enough (never in the last 2 steps of the run)."""
        self._read()
        i = len(self.log)
        if i >= len(self.gaps) or i not in self._trained_from or max(self._trained_from) != i:
            return
        if self._last_step.get(i, -1) >= self.steps - 2 or time.monotonic() - self._trained_from[i] < self.gaps[i]:
            return
        rank = int(self.ranks[i])
        pid = self._pids.get((i, rank))
        if pid is None or not is_rank_of(pid, self.run_dir):
            return  # not recorded yet, or gone: the next poll looks again
        os.kill(pid, signal.SIGKILL)
        self.log.append(
            {
                "attempt": i,
                "rank": rank,
                "pid": pid,
                "gap_s": float(self.gaps[i]),
                "time": time.time(),
                "step": self._last_step.get(i, -1),
            }
        )


def count_line(run, log, kills: int, mean_gap_s: float, seed: int) -> str:
    """Why the interrupted `run` had len(log) kills: all `kills` it allows, or, from its records, how long the
    attempt that should have had the next one trained (from its first step or restart record, as the interrupter's
    clock) before its last 2 steps, where no kill comes, against the seeded time that kill was due."""
    n = len(log)
    if n >= kills:
        return f"this one stopped after {n} kills, the most it allows ({kills})"
    due = kill_plan(kills, mean_gap_s, run.nproc, seed)[0][n]  # the plan interrupted_run drew
    st, rs = run.steps[run.steps["attempt"] == n], run.restarts
    starts = list(st["time"]) + (list(rs.loc[rs["attempt"] == n, "wall_time"]) if n > 0 and not rs.empty else [])
    last = int(run.config.steps) - 2
    ends = st.loc[st["step"] >= last, "time"]
    if not starts or ends.empty:
        return f"this one stopped after {n} kills of {kills}: attempt {n} has no records of its last 2 steps"
    trained = float(ends.min()) - min(starts)
    verdict = (
        "it reached them first"
        if trained < due
        else f"it reached them {fmt_time(trained - due)} after the kill was due: the interrupter missed it"
    )
    return (
        f"this one stopped after {n} kills of {kills}: kill {n + 1} was due after {fmt_time(due)} of training; "
        f"attempt {n} had trained {fmt_time(trained)} (its records) when it reached step {last}, its last 2 steps, "
        f"where no kill comes: {verdict}"
    )


def kill_plan(kills: int, mean_gap_s: float, nproc: int, seed: int) -> tuple[list, list]:
    """(gaps, ranks): `kills` training times (s) drawn from an exponential of mean `mean_gap_s` (a Poisson process)
    and the rank each kill hits, from `seed`."""
    if kills < 1 or not mean_gap_s > 0:
        raise ValueError(f"kills must be >= 1 and mean_gap_s > 0 s, got {kills!r}, {mean_gap_s!r}")
    rng = np.random.default_rng(seed)
    return [float(g) for g in rng.exponential(mean_gap_s, kills)], [int(r) for r in rng.integers(0, nproc, kills)]


def interrupted_run(cfg, kills: int, mean_gap_s: float, seed: int = 0, poll_s: float = 0.02):
    """(run, log): `cfg` run with `kills` interruptions at most, each a SIGKILL to a seeded random rank after the
    attempt trained a seeded exponential time of mean `mean_gap_s` seconds (see the module docstring). cfg needs
    checkpoint_every > 0 and max_restarts > kills. A kill due after the run's last steps never comes: `log` holds
    the kills that happened."""
    if cfg.restarts.max_restarts <= kills or cfg.restarts.checkpoint_every < 1:
        raise ValueError(
            f"cfg: needs checkpoint_every >= 1 and max_restarts > kills = {kills} (torchrun restarts the group once "
            f"per kill), got checkpoint_every {cfg.restarts.checkpoint_every}, max_restarts "
            f"{cfg.restarts.max_restarts}"
        )
    gaps, ranks = kill_plan(kills, mean_gap_s, cfg.nproc, seed)
    handle = launch(cfg)
    killer = Interrupter(handle.run_dir, gaps, ranks, cfg.steps)
    run = handle.wait(progress=False, poll_s=poll_s, on_poll=killer.poll)
    return run, killer.log
