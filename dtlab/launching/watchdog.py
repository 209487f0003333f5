"""The watchdog in `Handle.wait()`: follow every rank's event file, catch a rank that goes silent, get its stack.

- `RankFeed`: what the launcher has seen of one rank (its events read incrementally, when it last spoke).
- `StallWatch`: the mixin Handle inherits. `stall_threshold` says how long a rank may be silent; `_watch` finds
  the ranks past it; `_on_stall` names the culprit(s) (a frozen rank, else the ranks behind the others, else all
  that went silent), asks every live rank for its Python stacks (SIGUSR1 to faulthandler, SIGCONT to a frozen
  one so it can answer) and stops the run as 'stalled'.
- `_stack_top`: the innermost frame of a faulthandler dump, for the one-line report.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import time

from dtlab.launching.failures import PROGRESS_KINDS, progress_of, stall_sentence
from dtlab.launching.torchrun import file_size, kill_pid, proc_state, read_from
from dtlab.results.events import RankTail

# The watchdog's defaults (RunConfig.stall_s = None). Before its first step a rank imports torch, joins the
# rendezvous, builds (or downloads) the model, tokenises its data and, under ZeRO-3, builds DeepSpeed's engine:
# minutes on a busy machine, so it gets a generous allowance; the run's timeout_s still bounds everything.
STARTUP_ALLOWANCE_S = 600.0
MIN_STALL_S = 60.0
STALL_STEPS = 10  # derived stall_s = max(MIN_STALL_S, STALL_STEPS x the median step time seen so far)
STACK_WAIT_S = 3.0  # how long a stall waits for the ranks' stack dumps to land in their logs


class RankFeed:
    """What the launcher has seen of one rank: its event file read incrementally, and when it last spoke."""

    def __init__(self, rank: int, path: str, now: float):
        self.rank, self.path = rank, path
        self.tail = RankTail(path)  # the one follower of event files: damaged lines skipped as every reader does
        self.last_seen = now  # monotonic time of the last new event (launch time until the first)
        self.last: dict = {}  # the last event
        self.pid: int | None = None
        self.progress = 0  # progress events seen (steps, calibration samples)
        self.ended = False  # wrote 'done' or 'error': no longer watched
        self.t_steps: list[float] = []
        self.progress_events: list[dict] = []
        self.attempt = 0  # torchrun's restart count of the rank's latest process
        self.restarting = False  # its process died while restarts remain: torchrun is starting it again

    def read(self, now: float) -> list[dict]:
        """The rank's events completed since the last read (dtlab.results.events.RankTail), taken into account."""
        events = self.tail.read()
        for ev in events:
            kind = ev.get("kind")
            self.last = ev
            if kind == "start":
                if self.pid is not None:  # a restarted process (torchrun --max-restarts): starting up again
                    self.progress, self.progress_events, self.ended = 0, [], False
                self.pid, self.attempt, self.restarting = ev.get("pid"), int(ev.get("attempt") or 0), False
            elif kind in ("done", "error"):
                self.ended = True
            if kind in PROGRESS_KINDS:
                self.progress += 1
                self.progress_events = [ev]
            if kind in ("step", "baseline_step") and isinstance(ev.get("t_step"), (int, float)):
                self.t_steps.append(float(ev["t_step"]))
        if events:
            self.last_seen = now
        return events

    def where(self) -> str:
        if not self.last:
            return "no event yet"
        return progress_of(self.progress_events + [self.last] if self.progress_events else [self.last])


class StallWatch:
    """The watchdog half of Handle. Uses the handle's `_feeds`, `stall_s`, `run_dir`, `_stall` and `_end()`."""

    def stall_threshold(self, stepping: bool) -> float:
        """Seconds of silence allowed to a rank: stall_s (or max(60 s, 10 x the median step time seen so far))
        once it is stepping; max(stall_s, 600 s) before its first step."""
        if not stepping:
            return max(self.stall_s or 0.0, STARTUP_ALLOWANCE_S)
        if self.stall_s is not None:
            return self.stall_s
        steps = [t for f in self._feeds for t in f.t_steps]
        return max(MIN_STALL_S, STALL_STEPS * statistics.median(steps)) if steps else MIN_STALL_S

    def _watch(self, bar) -> list | None:
        """The ranks silent past their threshold (None if none); the bar shows a rank going quiet first."""
        now = time.monotonic()
        self._note_restarts(now)
        watched = [f for f in self._feeds if not f.ended]
        if not watched:
            return None
        silent = {f.rank: now - f.last_seen for f in watched}
        limit = {f.rank: self.stall_threshold(f.progress > 0) for f in watched}
        over = [f for f in watched if silent[f.rank] > limit[f.rank]]
        if over:
            return over
        worst = max(watched, key=lambda f: silent[f.rank])
        if bar is not None and worst.progress > 0 and silent[worst.rank] >= min(10.0, limit[worst.rank] / 2):
            bar.set_postfix_str(f"rank {worst.rank} silent for {silent[worst.rank]:.0f} s")
        return None

    def _note_restarts(self, now: float) -> None:
        """With restarts left (torchrun --max-restarts), a rank whose process is gone is not stalled: torchrun is
        stopping the group and starting it again. Each such rank gets the start-up allowance from now until its
        new process writes `start`. When the restarts are used up torchrun exits and status() reports the
        failure, so nothing here can hide one."""
        max_restarts = getattr(self, "max_restarts", 0)
        if not max_restarts or max(f.attempt for f in self._feeds) >= max_restarts:
            return
        for f in self._feeds:
            finished = f.last.get("kind") == "done"  # gone because it is done: nothing to restart
            if f.pid is not None and not f.restarting and not finished and proc_state(f.pid) in (None, "Z", "X"):
                f.restarting, f.ended, f.progress, f.progress_events, f.last_seen = True, False, 0, [], now

    def _on_stall(self, over: list) -> None:
        """Name the stalled rank(s), get every live rank's Python stack into its log, stop the run."""
        now = time.monotonic()
        watched = [f for f in self._feeds if not f.ended]
        states = {f.rank: proc_state(f.pid) for f in watched}
        frozen = [f for f in watched if states[f.rank] in ("T", "t")]
        lowest = min(f.progress for f in watched)
        behind = [f for f in watched if f.progress == lowest]
        if frozen:  # stopped (SIGSTOP, a debugger): certainly the culprit; the others wait on it
            culprits, why = frozen, "frozen (process state T: SIGSTOP or a debugger)"
        elif len(behind) < len(watched):  # the others got further: they cannot be what holds it up
            culprits, why = behind, "behind the other ranks"
        else:
            culprits, why = over, None
        silent = {f.rank: round(now - f.last_seen, 1) for f in watched}
        stacks = self._dump_stacks(
            [f for f in watched if states[f.rank] not in (None, "Z", "X")], resume=[f.pid for f in frozen]
        )
        rows = []
        for f in watched:
            rows.append(
                {
                    "rank": f.rank,
                    "pid": f.pid,
                    "silent_s": silent[f.rank],
                    "where": f.where(),
                    "last_kind": f.last.get("kind"),
                    "last_step": f.last.get("step"),
                    "culprit": f in culprits,
                    "frozen": f in frozen,
                    "stack": stacks.get(f.rank, ""),
                    "stack_top": _stack_top(stacks.get(f.rank, "")),
                }
            )
        threshold = self.stall_threshold(max(f.progress for f in culprits) > 0)
        self._stall = {
            "ranks": [f.rank for f in culprits],
            "why": why,
            "threshold_s": threshold,
            "stall_s": self.stall_s,
            "rows": rows,
        }
        self._end(
            "stalled",
            error=stall_sentence(self._stall),
            stalled_ranks=self._stall["ranks"],
            frozen_ranks=[f.rank for f in frozen],
            silent_s={str(k): v for k, v in silent.items()},
        )

    def _on_timeout(self, timeout_s: float) -> None:
        """The run outlived timeout_s: get every live rank's Python stack into its log (as a stall does), then stop
        the run with the innermost frame of each in the error, so a rank stuck before its first step says where."""
        watched = [
            f for f in self._feeds if not f.ended and f.pid is not None and proc_state(f.pid) not in (None, "Z", "X")
        ]
        stacks = self._dump_stacks(watched, resume=[])
        tops = {f.rank: _stack_top(stacks.get(f.rank, "")) for f in watched}
        where = "; ".join(f"rank {r}: {t}" for r, t in sorted(tops.items()) if t)
        error = f"timeout_s={timeout_s:g} s exceeded" + (
            f"; where the ranks were (stacks in their logs): {where}" if where else ""
        )
        self._end("timeout", error=error, stack_tops={str(r): t for r, t in tops.items()})

    def _dump_stacks(self, feeds: list, resume: list) -> dict:
        """SIGUSR1 to each rank (faulthandler writes every thread's stack to its log), then SIGCONT to the
        frozen ones: the pending SIGUSR1 is delivered as soon as they resume, before they run another line,
        so the stack shows where they were frozen. Returns {rank: the text that landed in its log}."""
        logs = {f.rank: os.path.join(self.run_dir, "logs", f"rank{f.rank}.log") for f in feeds}
        size = {r: file_size(p) for r, p in logs.items()}
        for f in feeds:
            kill_pid(f.pid, signal.SIGUSR1)
        for pid in resume:
            kill_pid(pid, signal.SIGCONT)
        prev: dict[int, str] = {}
        done: dict[int, str] = {}
        deadline = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < deadline and len(done) < len(logs):
            time.sleep(0.1)
            for r, p in logs.items():
                if r in done:
                    continue
                text = read_from(p, size[r])
                if "(most recent call first)" in text and text == prev.get(r):  # stopped growing: complete
                    done[r] = text
                prev[r] = text
        return {r: done.get(r, prev.get(r, "")) for r in logs}


def _stack_top(dump: str) -> str:
    """'file:line in func' of the innermost frame of the main thread in a faulthandler dump, plus the
    innermost dtlab frame when that is elsewhere (where in the training loop the rank was)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    frames = []
    for b in blocks:
        fr = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', b)
        if fr and any(f[2] in ("<module>", "_run_module_as_main") for f in fr):
            frames = fr
            break
    if not frames:
        return ""
    fmt = lambda f: f"{os.path.basename(f[0])}:{f[1]} in {f[2]}"  # noqa: E731
    top = fmt(frames[0])
    ours = next((f for f in frames if f"{os.sep}dtlab{os.sep}" in f[0]), None)
    return top if ours is None or ours == frames[0] else f"{top} (in dtlab: {fmt(ours)})"
