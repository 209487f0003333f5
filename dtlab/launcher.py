"""Start torchrun from the notebook kernel, watch the ranks, and bring results back from disk.

The kernel never initialises CUDA and never forks itself into ranks: it starts `torchrun` as a subprocess
in a new session (so the whole group can be stopped together), follows every rank's event file, and loads
the run directory when the ranks are done.

- Rendezvous: torchrun's c10d rendezvous on 127.0.0.1 port 0. The agent's TCP store binds a port the OS
  picks and the ranks connect to that same store, so two launches can never race for a port (no
  "find a free port, then hope nobody takes it before torchrun binds it").
- Faults: torchrun's agent is wrapped so that, when ranks fail, what it knows about each of them (exit code,
  signal, pid) lands in RUN_DIR/exits.json. RunFailed names the rank that caused the failure from that and
  the ranks' own error events, and reports the ranks that only lost their peer as consequences.
- Watchdog (in `wait()`): a rank that writes no event for `stall_s` seconds is asked for its Python stacks
  (SIGUSR1, faulthandler; a SIGSTOPped rank is continued to answer), the run is stopped and RunFailed names it.
- No leftovers: an interrupt, a timeout, a stall or a failing rank stops every process, and every rank PID
  of the run is gone before `wait()` or `stop()` returns; the ranks also die with torchrun (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid

from dtlab.config import RunConfig, dump_json
from dtlab.results import Run, RunFailed, load_run, read_events

_LIVE: "set[Handle]" = set()  # strong references: a handle dropped by the user must still be stopped at exit

# The watchdog's defaults (RunConfig.stall_s = None). Before its first step a rank imports torch, joins the
# rendezvous, builds (or downloads) the model, tokenises its data and, under ZeRO-3, builds DeepSpeed's engine:
# minutes on a busy machine, so it gets a generous allowance; the run's timeout_s still bounds everything.
STARTUP_ALLOWANCE_S = 600.0
MIN_STALL_S = 60.0
STALL_STEPS = 10  # derived stall_s = max(MIN_STALL_S, STALL_STEPS x the median step time seen so far)
PROGRESS_KINDS = ("step", "baseline_step", "sample", "calib")  # events that mean "this rank is stepping"
RANK_MODULES = ("dtlab.rank.worker", "dtlab.rank.calibration")
STACK_WAIT_S = 3.0  # how long a stall waits for the ranks' stack dumps to land in their logs


def free_port() -> int:
    """A TCP port free on loopback right now. Racy by nature (someone may take it before it is used): the
    launcher no longer uses it (port 0 rendezvous); kept for scripts that start torchrun by hand."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique_dir(parent: str, name: str) -> str:
    """Create and return parent/name-<timestamp>, with -2, -3, ... when two jobs start within the same
    second. Created with mkdir, which fails when the directory exists, so two launches never share one."""
    os.makedirs(parent, exist_ok=True)
    base = os.path.join(parent, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    k = 1
    while True:
        path = base if k == 1 else f"{base}-{k}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            k += 1


def default_out(cfg: RunConfig) -> str:
    return unique_dir("runs", f"{cfg.strategy}-{cfg.model}-p{cfg.nproc}-b{cfg.bucket_mb:g}")


class _Feed:
    """What the launcher has seen of one rank: its event file read incrementally, and when it last spoke."""

    def __init__(self, rank: int, path: str, now: float):
        self.rank, self.path = rank, path
        self.offset, self.partial = 0, b""
        self.last_seen = now  # monotonic time of the last new event (launch time until the first)
        self.last: dict = {}  # the last event
        self.pid: int | None = None
        self.progress = 0  # progress events seen (steps, calibration samples)
        self.ended = False  # wrote 'done' or 'error': no longer watched
        self.t_steps: list[float] = []
        self.progress_events: list[dict] = []

    def read(self, now: float) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = self.partial + f.read()
            self.offset = f.tell()
        *lines, self.partial = data.split(b"\n")
        events = []
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            events.append(ev)
            kind = ev.get("kind")
            self.last = ev
            if kind == "start":
                self.pid = ev.get("pid")
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
        return _where(self.progress_events + [self.last] if self.progress_events else [self.last])


class Handle:
    """A launched job: `status()`, `wait()`, `stop()`. Returned by `launch()`; `run()` waits on one."""

    def __init__(self, run_dir: str, proc: subprocess.Popen, nproc: int, total_steps: int, timeout_s: float,
                 desc: str, loader=load_run, unit: str = "step", stall_s: float | None = None):
        self.run_dir, self.proc, self.nproc = run_dir, proc, nproc
        self.total_steps, self.timeout_s, self.desc = total_steps, timeout_s, desc
        self.stall_s = stall_s
        self.started = time.time()
        self._t0 = time.monotonic()
        self._loader = loader
        self.unit = unit
        self._state = "running"
        self._stall: dict | None = None
        self._feeds = [_Feed(r, os.path.join(run_dir, "events", f"rank{r}.jsonl"), self._t0) for r in range(nproc)]
        _LIVE.add(self)

    # ---- state ------------------------------------------------------------------------------------------
    def status(self) -> str:
        """'running', 'finished', 'failed', 'stalled', 'stopped', 'timeout' or 'interrupted'."""
        if self._state == "running" and self.proc.poll() is not None:
            self._finish("finished" if self.proc.returncode == 0 else "failed")
        return self._state

    def _finish(self, state: str, **extra) -> None:
        self._state = state
        _LIVE.discard(self)
        _write_status(self.run_dir, state, returncode=self.proc.returncode, pid=self.proc.pid,
                      started=self.started, ended=time.time(), **extra)

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
            _signal_group(self.proc.pid, signal.SIGTERM)
            for pid in self.live_rank_pids():
                _kill(pid, signal.SIGCONT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + 10.0
        while True:  # the ranks die with torchrun (PDEATHSIG); make sure before returning
            live = self.live_rank_pids()
            if not live or time.monotonic() > deadline:
                break
            for pid in live:
                _kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def rank_pids(self) -> list[int]:
        """PIDs the ranks recorded in their start events."""
        pids = []
        for r in range(self.nproc):
            p = os.path.join(self.run_dir, "events", f"rank{r}.jsonl")
            if os.path.exists(p):
                pids += [e["pid"] for e in read_events(p) if e.get("kind") == "start"]
        return pids

    def live_rank_pids(self) -> list[int]:
        """Rank processes of this run still alive: the recorded PIDs, plus any process started for this run
        directory that had not recorded itself yet (a rank still importing torch)."""
        pids = set(self.rank_pids()) | set(_rank_processes(self.run_dir))
        return sorted(p for p in pids if _is_rank_of(p, self.run_dir))

    # ---- waiting ----------------------------------------------------------------------------------------
    def wait(self, progress: bool = True, poll_s: float = 0.2):
        """Block until the job ends; show a progress bar with the live step time. Returns the loaded result.

        Raises RunFailed if a rank failed, a rank stalled (the watchdog, see `RunConfig.stall_s`), the timeout
        passed, or the wait was interrupted (the job is stopped first in each case; KeyboardInterrupt is
        re-raised after stopping). Every rank PID of the run is gone when this returns or raises."""
        bar = _bar(self.total_steps, self.desc, self.unit) if progress else None
        try:
            while self.status() == "running":
                self._follow(bar)
                if time.time() - self.started > self.timeout_s:
                    self._end("timeout", error=f"timeout_s={self.timeout_s:g} s exceeded")
                    break
                stalled = self._watch(bar)
                if stalled:
                    self._on_stall(stalled)
                    break
                time.sleep(poll_s)
            self._follow(bar)
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
        if self._state == "finished":
            return self._loader(self.run_dir)
        try:
            partial = self._loader(self.run_dir)
        except Exception:  # noqa: BLE001 - a failed job may not load; the events still name the cause
            partial = None
        raise _failure(self._state, self.run_dir, partial, self._stall)

    def _follow(self, bar) -> None:
        """Read the new complete lines of every rank's events; rank 0's drive the progress bar."""
        now = time.monotonic()
        for feed in self._feeds:
            events = feed.read(now)
            if bar is None or feed.rank != 0:
                continue
            for ev in events:
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

    # ---- the watchdog -----------------------------------------------------------------------------------
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

    def _on_stall(self, over: list) -> None:
        """Name the stalled rank(s), get every live rank's Python stack into its log, stop the run."""
        now = time.monotonic()
        watched = [f for f in self._feeds if not f.ended]
        states = {f.rank: _proc_state(f.pid) for f in watched}
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
        stacks = self._dump_stacks([f for f in watched if states[f.rank] not in (None, "Z", "X")],
                                   resume=[f.pid for f in frozen])
        rows = []
        for f in watched:
            rows.append({"rank": f.rank, "pid": f.pid, "silent_s": silent[f.rank], "where": f.where(),
                         "last_kind": f.last.get("kind"), "last_step": f.last.get("step"),
                         "culprit": f in culprits, "frozen": f in frozen, "stack": stacks.get(f.rank, ""),
                         "stack_top": _stack_top(stacks.get(f.rank, ""))})
        threshold = self.stall_threshold(max(f.progress for f in culprits) > 0)
        self._stall = {"ranks": [f.rank for f in culprits], "why": why, "threshold_s": threshold,
                       "stall_s": self.stall_s, "rows": rows}
        self._end("stalled", error=_stall_sentence(self._stall),
                  stalled_ranks=self._stall["ranks"], silent_s={str(k): v for k, v in silent.items()})

    def _dump_stacks(self, feeds: list, resume: list) -> dict:
        """SIGUSR1 to each rank (faulthandler writes every thread's stack to its log), then SIGCONT to the
        frozen ones: the pending SIGUSR1 is delivered as soon as they resume, before they run another line,
        so the stack shows where they were frozen. Returns {rank: the text that landed in its log}."""
        logs = {f.rank: os.path.join(self.run_dir, "logs", f"rank{f.rank}.log") for f in feeds}
        size = {r: _size(p) for r, p in logs.items()}
        for f in feeds:
            _kill(f.pid, signal.SIGUSR1)
        for pid in resume:
            _kill(pid, signal.SIGCONT)
        prev: dict[int, str] = {}
        done: dict[int, str] = {}
        deadline = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < deadline and len(done) < len(logs):
            time.sleep(0.1)
            for r, p in logs.items():
                if r in done:
                    continue
                text = _read_from(p, size[r])
                if "(most recent call first)" in text and text == prev.get(r):  # stopped growing: complete
                    done[r] = text
                prev[r] = text
        return {r: done.get(r, prev.get(r, "")) for r in logs}


def _failure(state: str, run_dir: str, run, stall: dict | None = None) -> RunFailed:
    """Build the RunFailed for a run that ended in `state`, naming the rank that caused it."""
    if state == "stalled" and stall:
        return _stall_failure(run_dir, run, stall)
    outcomes = _rank_outcomes(run_dir)
    if state == "failed" and outcomes:
        cause = min(outcomes, key=lambda o: (o["class"], o["time"], o["rank"]))
        others = [o for o in outcomes if o is not cause]
        r = cause["rank"]
        how = _how(cause)
        where = f" ({cause['where']})" if cause.get("where") else ""
        cons = ""
        if others:
            cons = " As a consequence: " + "; ".join(f"rank {o['rank']} {_how(o, short=True)}" for o in others) + "."
        log_tail = _tail(os.path.join(run_dir, "logs", f"rank{r}.log"))
        msg = (f"rank {r} {how}{where}.{cons} Run directory: {run_dir}\n"
               f"--- logs/rank{r}.log (last lines) ---\n{log_tail or '(empty)'}")
        return RunFailed(msg, rank=r, error=cause.get("error") or how, traceback_tail=cause.get("traceback_tail", ""),
                         run_dir=run_dir, run=run, state=state, signal=cause.get("signal"),
                         exitcode=cause.get("exitcode"), log_tail=log_tail,
                         consequences=[{k: o.get(k) for k in ("rank", "how", "error", "signal", "exitcode")}
                                       for o in others])
    log = os.path.join(run_dir, "logs", "torchrun.log")
    tail = _tail(log)
    what = {"timeout": "run timeout: timeout_s exceeded, every rank was stopped",
            "interrupted": "run interrupted: every rank was stopped",
            "stopped": "run stopped: every rank was stopped"}.get(state, f"run {state}: no rank recorded an error")
    where = "; ".join(f"rank {o['rank']} {o['where']}" for o in _last_events(run_dir))
    return RunFailed(f"{what}{' (' + where + ')' if where else ''}. Run directory: {run_dir}\n"
                     f"--- logs/torchrun.log (last lines) ---\n{tail}",
                     error=state, traceback_tail=tail, run_dir=run_dir, run=run, state=state, log_tail=tail)


def _stall_failure(run_dir: str, run, stall: dict) -> RunFailed:
    rows = {row["rank"]: row for row in stall["rows"]}
    named = stall["ranks"]
    first = rows[named[0]]
    log_tail = _tail(os.path.join(run_dir, "logs", f"rank{named[0]}.log"), 30)
    msg = (f"{_stall_sentence(stall)} Each rank's Python stack is in its log. Run directory: {run_dir}\n"
           f"--- logs/rank{named[0]}.log (last lines) ---\n{log_tail or '(empty)'}")
    return RunFailed(msg, rank=named[0], ranks=named, error=f"stalled: {first['where']}, silent {first['silent_s']:g} s",
                     traceback_tail=first["stack"], run_dir=run_dir, run=run, state="stalled",
                     signal="SIGSTOP" if first["frozen"] else None, log_tail=log_tail,
                     silent_s={r: rows[r]["silent_s"] for r in named},
                     consequences=[{"rank": r, "how": f"waiting: {row['where']}, silent {row['silent_s']:g} s",
                                    "error": None, "signal": None, "exitcode": None}
                                   for r, row in rows.items() if r not in named])


def _stall_sentence(stall: dict) -> str:
    rows = {row["rank"]: row for row in stall["rows"]}
    limit = (f"stall_s={stall['stall_s']:g} s" if stall["stall_s"] is not None
             else f"derived limit {stall['threshold_s']:g} s")
    parts = []
    for r in stall["ranks"]:
        row = rows[r]
        top = f"; stack top: {row['stack_top']}" if row["stack_top"] else "; no stack dump arrived"
        parts.append(f"rank {r} stalled: no event for {row['silent_s']:g} s ({limit}); "
                     f"{'frozen (SIGSTOP); ' if row['frozen'] else ''}{row['where']}{top}")
    s = ". ".join(parts) + "."
    if stall["why"] is None and len(stall["ranks"]) > 1:
        s += " Could not tell which of them holds up the others: compare their stacks."
    waiting = [row for r, row in rows.items() if r not in stall["ranks"]]
    if waiting:
        s += " Waiting on it: " + "; ".join(f"rank {row['rank']} ({row['where']}, silent {row['silent_s']:g} s)"
                                           for row in waiting) + "."
    return s


# How a rank ended, as a cause: lower class = more likely the cause.
#  0 died without recording an error (a signal other than SIGTERM, or a non-zero exit code): kill -9, the OOM
#    killer, a segfault, os._exit. Nothing a peer does makes a rank die like that.
#  1 recorded an error that is not a lost connection.
#  2 ended by SIGTERM without recording an error: usually torchrun stopping the survivors of a failure.
#  3 recorded a lost connection to a peer (gloo "Connection reset by peer", NCCL "remote process exited").
_PEER_LOST = re.compile(r"connection (reset|closed) by peer|broken pipe|socket closed|remote process exited|"
                        r"connection refused|timed out|timeout|communicator was aborted|end of file|"
                        r"distnetworkerror", re.IGNORECASE)
_SIGNAL_HINT = {"SIGKILL": "killed from outside: kill -9, or the kernel's out-of-memory killer (see dmesg)",
                "SIGSEGV": "a crash in native code", "SIGBUS": "a crash in native code",
                "SIGABRT": "an abort in native code", "SIGILL": "a crash in native code",
                "SIGFPE": "a crash in native code", "SIGTERM": "stopped (by torchrun after another rank failed, "
                "or from outside)", "SIGINT": "interrupted"}


def _rank_outcomes(run_dir: str) -> list[dict]:
    """Every rank that ended badly, from its own error event and from torchrun's exit record."""
    exits = {}
    path = os.path.join(run_dir, "exits.json")
    if os.path.exists(path):
        try:
            with open(path) as f:
                exits = {int(k): v for k, v in json.load(f).items()}
        except (OSError, ValueError):
            exits = {}
    errors, last = {}, {}
    for p in glob.glob(os.path.join(run_dir, "events", "rank*.jsonl")):
        evs = read_events(p)
        for e in evs:
            if e.get("kind") == "error" and e.get("rank") not in errors:
                errors[e["rank"]] = e
        if evs and "rank" in evs[0]:
            last[evs[0]["rank"]] = evs
    out = []
    for r in sorted(set(exits) | set(errors)):
        ex, err = exits.get(r, {}), errors.get(r)
        code = ex.get("exitcode")
        sig = ex.get("signal") if isinstance(code, int) and code < 0 else None
        o = {"rank": r, "exitcode": code, "signal": sig, "where": _where(last.get(r))}
        if err is not None:
            o.update(error=err.get("error", ""), time=float(err.get("time") or 0),
                     traceback_tail="\n".join(err.get("traceback", "").strip().splitlines()[-12:]),
                     **{"class": 3 if _PEER_LOST.search(err.get("error", "")) else 1})
        elif code:
            o.update(error=None, time=float(ex.get("timestamp") or 0), **{"class": 2 if sig == "SIGTERM" else 0})
        else:
            continue
        o["how"] = _how(o, short=True)
        out.append(o)
    return out


def _short_error(err: str, limit: int) -> str:
    """One line: no source locations ("[/__w/.../pair.cc:537] "), cut at a sentence end past `limit`."""
    err = re.sub(r"\[/[^\]]*:\d+\]\s*", "", " ".join(err.split()))
    if len(err) > limit:
        cut = err.find(". ", limit // 2)
        err = err[:cut + 1] if 0 < cut <= limit else err[:limit - 3] + "..."
    return err


def _how(o: dict, short: bool = False) -> str:
    if o.get("error"):
        if short and o["class"] == 3:
            return f"lost its peer ({_short_error(o['error'], 120)})"
        return f"failed: {_short_error(o['error'], 120 if short else 400)}"
    if o.get("signal"):
        hint = _SIGNAL_HINT.get(o["signal"], "")
        if short:
            return f"ended by {o['signal']}" + (" (stopped by torchrun)" if o["signal"] == "SIGTERM" else "")
        return (f"died from signal {o['signal']} (exit code {o['exitcode']}) without recording an error"
                + (f": {hint}" if hint else ""))
    return (f"exited with code {o['exitcode']} without recording an error (os._exit, or a crash before its "
            f"event file opened; see its log)")


def _where(events: list | None) -> str:
    """Where a rank had got to, from its events: the last step it recorded (or that it had none yet)."""
    if not events:
        return ""
    prog = [e for e in events if e.get("kind") in PROGRESS_KINDS]
    if not prog:
        return f"before its first step (last event '{events[-1].get('kind')}')"
    e = prog[-1]
    if e.get("kind") in ("step", "baseline_step"):
        return f"after {'baseline ' if e['kind'] == 'baseline_step' else ''}step {e.get('step')}"
    return f"after {len(prog)} calibration events"


def _last_events(run_dir: str) -> list[dict]:
    out = []
    for p in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.jsonl"))):
        evs = read_events(p)
        if evs and "rank" in evs[0]:
            out.append({"rank": evs[0]["rank"], "where": _where(evs)})
    return out


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


# The torchrun agent, started through a shim that (1) asks Linux to SIGTERM it when the launching process dies
# (a kernel killed outright runs no atexit handler; torchrun then stops its ranks, which also die with it) and
# (2) writes what torchrun knows of each failed rank (exit code, signal, pid) to EXITS, so RunFailed can name
# the rank that died without guessing from the order of errors and without parsing torchrun's log.
_AGENT = """\
import ctypes, json, os, signal, sys
ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
try:
    main(sys.argv[3:])
except ChildFailedError as e:
    exits = {str(rank): {"rank": rank, "pid": f.pid, "exitcode": f.exitcode,
                         "signal": f.signal_name() if f.exitcode < 0 else None,
                         "timestamp": f.timestamp, "message": f.message} for rank, f in e.failures.items()}
    with open(sys.argv[2] + ".tmp", "w") as fh:
        json.dump(exits, fh, indent=2, default=str)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    raise
"""


def start_torchrun(run_dir: str, nproc: int, module: str, gloo_threads: bool) -> subprocess.Popen:
    """Start `torchrun -m MODULE RUN_DIR` in its own session, rendezvous on a port the OS picks."""
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    if gloo_threads and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the cores: give each its share instead of torchrun's default of 1 thread.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # The package must be importable by the ranks even when the kernel found it through sys.path alone.
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    run_dir = os.path.abspath(run_dir)
    # c10d rendezvous on port 0: the agent's store binds a port the OS picks and the ranks use that store
    # (TORCHELASTIC_USE_AGENT_STORE), so there is no window in which another launch could take the port.
    # (--master-port=0 does not work: the static rendezvous hands the ranks port 0 and they hang.)
    cmd = [sys.executable, "-c", _AGENT, str(os.getpid()), os.path.join(run_dir, "exits.json"),
           "--nnodes=1", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
           f"--rdzv-id={uuid.uuid4().hex}", "--local-addr=127.0.0.1", "--max-restarts=0",
           f"--log-dir={os.path.join(run_dir, 'logs', 'torchrun')}", "-m", module, run_dir]
    log = open(os.path.join(run_dir, "logs", "torchrun.log"), "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    log.close()
    return proc


def prepare_dir(out: str) -> str:
    """Create the run directory; refuse one that already holds a run. Claimed with mkdir of its events/
    folder, which only one of two simultaneous launches can win."""
    if os.path.exists(os.path.join(out, "config.json")):
        raise ValueError(f"out: {out!r} already holds a run; choose a new directory (runs are never overwritten)")
    os.makedirs(out, exist_ok=True)
    try:
        os.mkdir(os.path.join(out, "events"))
    except FileExistsError:
        raise ValueError(f"out: {out!r} already holds a run (or another launch just claimed it); choose a new "
                         f"directory (runs are never overwritten)") from None
    return out


def launch(config: RunConfig) -> Handle:
    """Validate `config` (fields, data file, machine), write the run directory and start the ranks; return
    at once with a `Handle`. Nothing is created or started when validation fails."""
    cfg = config.validate()
    out = prepare_dir(cfg.out or default_out(cfg))
    cfg = cfg.replace(out=out) if cfg.out != out else cfg
    backend = cfg.resolved_backend()
    dump_json({"config": cfg.to_dict(), "launch": {"time": time.time(), "python": sys.executable,
                                                   "backend": backend}}, os.path.join(out, "config.json"))
    proc = start_torchrun(out, cfg.nproc, "dtlab.rank.worker", gloo_threads=backend == "gloo")
    _write_status(out, "running", pid=proc.pid, started=time.time())
    desc = f"{cfg.strategy} {cfg.model} x{cfg.nproc} ({backend})"
    return Handle(out, proc, cfg.nproc, cfg.steps + cfg.baseline_steps, cfg.timeout_s, desc, stall_s=cfg.stall_s)


def run(config: RunConfig, progress: bool = True) -> Run:
    """Launch and wait: the run's `Run` on success; `RunFailed` (with the partial run) otherwise."""
    return launch(config).wait(progress=progress)


def _write_status(run_dir: str, state: str, **fields) -> None:
    dump_json({"state": state, **fields}, os.path.join(run_dir, "status.json"))


def _argv(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _is_rank_of(pid: int, run_dir: str) -> bool:
    """True if `pid` is alive and is a rank started for `run_dir`: its arguments include the run directory
    itself (not merely a path that starts with it) and a dtlab rank module. Never a reused PID."""
    argv = _argv(pid)  # a zombie has an empty command line: dead for our purposes
    return (os.path.abspath(run_dir).encode() in argv and any(m.encode() in argv for m in RANK_MODULES)
            and argv[1:2] != [b"-c"] and pid != os.getpid())  # "-c": torchrun's agent (our shim), not a rank


def _rank_processes(run_dir: str) -> list[int]:
    """Every live rank process of `run_dir`, found by its command line in /proc."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _is_rank_of(int(name), run_dir):
            pids.append(int(name))
    return pids


def _proc_state(pid: int | None) -> str | None:
    """The kernel's one-letter state of a process (R, S, D, T stopped, Z zombie, ...), None if gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _kill(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(os.getpgid(pid), sig)
    except (ProcessLookupError, PermissionError):
        pass


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _tail(path: str, n: int = 12) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "\n".join(f.read().strip().splitlines()[-n:])


def _bar(total: int, desc: str, unit: str = "step"):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit=unit)


@atexit.register
def _stop_all() -> None:
    """No run outlives the Python process that started it."""
    for h in list(_LIVE):
        if h.proc.poll() is None:
            h.stop(grace_s=3.0)
