"""Why a run failed: the rank that caused it, the ranks that only followed, and the RunFailed that says so.

- `run_failure(state, run_dir, run, stall)`: the RunFailed for a run that ended in `state`. For a failed run the
  culprit is chosen from RUN_DIR/exits.json (torchrun's exit code / signal per rank) and the ranks' own error
  events: a rank that died without recording an error beats one that raised, which beats one SIGTERMed by
  torchrun, which beats one that only lost its peer. The others are reported as consequences, with the
  culprit's log tail.
- `_stall_failure` / `stall_sentence`: the report for a run the watchdog stopped (see dtlab.launching.watchdog).
- `progress_of`: where a rank had got to, from its events (shared with the watchdog).
- Multi-node jobs: every node's exit records (nodes/node{k}.exits.json) are read, so a node whose ranks only
  lost their peer names the rank that died on another node; ranks are labelled with their node and host; a
  failed rendezvous is reported by dtlab.launching.nodes.rendezvous_sentence (endpoint, missing nodes).
"""

from __future__ import annotations

import glob
import json
import os
import re

from dtlab.launching.nodes import rendezvous_sentence
from dtlab.launching.torchrun import last_lines
from dtlab.results.events import read_events
from dtlab.results.restarts import attempt_of, final_attempt_events
from dtlab.results.status import RunFailed, node_statuses
from dtlab.runfiles import RANK_EXIT_DISK_FULL, disk_sentence, looks_full

PROGRESS_KINDS = ("step", "baseline_step", "sample", "calib")  # events that mean "this rank is stepping"


def run_failure(state: str, run_dir: str, run, stall: dict | None = None, node=None, disk=None) -> RunFailed:
    """Build the RunFailed for a run that ended in `state`, naming the rank that caused it (`node`: the
    dtlab.launching.nodes.NodeLaunch of the node reporting, for its rendezvous and its own torchrun log; `disk`:
    the DiskFull the launcher met writing the end state)."""
    multi = node is not None and node.multi
    full = _disk_failure(run_dir, run, disk) if state == "failed" else None
    if full is not None:
        return full
    if state == "stalled" and stall:
        failed = _stall_failure(run_dir, run, stall)
        frozen_here = any(row["frozen"] for row in stall["rows"])
        remote = _stalled_elsewhere(node, frozen=True) if multi and not frozen_here else None
        return _blame_remote(failed, remote) if remote else failed
    rdzv = rendezvous_sentence(node) if node is not None and state == "failed" else None
    log = node.log_path() if node is not None else os.path.join(run_dir, "logs", "torchrun.log")
    if rdzv:
        tail = last_lines(log)
        return RunFailed(
            f"{rdzv} Run directory: {run_dir}\n--- {os.path.relpath(log, run_dir)} (last lines) ---\n{tail}",
            error="rendezvous failed: " + rdzv,
            traceback_tail=tail,
            run_dir=run_dir,
            run=run,
            state=state,
            log_tail=tail,
        )
    outcomes = _rank_outcomes(run_dir)
    if state == "failed" and outcomes:
        cause = min(outcomes, key=lambda o: (o["class"], o["time"], o["rank"]))
        others = [o for o in outcomes if o is not cause]
        r = cause["rank"]
        how = _how(cause)
        where = f" ({cause['where']})" if cause.get("where") else ""
        cons = ""
        if others:
            cons = (
                " As a consequence: "
                + "; ".join(f"rank {o['rank']}{o['on']} {_how(o, short=True)}" for o in others)
                + "."
            )
        log_tail = last_lines(os.path.join(run_dir, "logs", f"rank{r}.log"))
        msg = (
            f"rank {r}{cause['on']} {how}{where}.{cons} Run directory: {run_dir}\n"
            f"--- logs/rank{r}.log (last lines) ---\n{log_tail or '(empty)'}"
        )
        failed = RunFailed(
            msg,
            rank=r,
            error=cause.get("error") or how,
            traceback_tail=cause.get("traceback_tail", ""),
            run_dir=run_dir,
            run=run,
            state=state,
            signal=cause.get("signal"),
            exitcode=cause.get("exitcode"),
            log_tail=log_tail,
            consequences=[{k: o.get(k) for k in ("rank", "how", "error", "signal", "exitcode")} for o in others],
        )
        # a rank here that only lost its peer (or was stopped): another node's watchdog may have stopped that peer
        remote = _stalled_elsewhere(node, frozen=False) if multi and cause["class"] >= 2 else None
        return _blame_remote(failed, remote) if remote else failed
    tail = last_lines(log)
    what = {
        "timeout": "run timeout: timeout_s exceeded, every rank was stopped",
        "interrupted": "run interrupted: every rank was stopped",
        "stopped": "run stopped: every rank was stopped",
    }.get(state, f"run {state}: no rank recorded an error")
    where = "; ".join(f"rank {o['rank']} {o['where']}" for o in _last_events(run_dir))
    return RunFailed(
        f"{what}{' (' + where + ')' if where else ''}. Run directory: {run_dir}\n"
        f"--- {os.path.relpath(log, run_dir)} (last lines) ---\n{tail}",
        error=state,
        traceback_tail=tail,
        run_dir=run_dir,
        run=run,
        state=state,
        log_tail=tail,
    )


_DISK_ERROR = re.compile(r"no space left on device|disk quota exceeded|errno 28\b|errno 122\b", re.IGNORECASE)


def _disk_failure(run_dir: str, run, disk) -> RunFailed | None:
    """The RunFailed naming the full disk and the path when a full disk ended the run, None otherwise: the launcher
    could not write the end state (`disk`), a rank recorded a disk error or exited with RANK_EXIT_DISK_FULL, or the
    run directory's filesystem has (almost) nothing left (a rank's own report then could not be written either)."""
    first = next(
        (
            o
            for o in _rank_outcomes(run_dir)
            if o.get("exitcode") == RANK_EXIT_DISK_FULL or _DISK_ERROR.search(o.get("error") or "")
        ),
        None,
    )
    if disk is None and first is None and not looks_full(run_dir):
        return None
    full = str(disk) if disk is not None else disk_sentence(run_dir)
    where = "; ".join(f"rank {o['rank']} {o['where']}" for o in _last_events(run_dir))
    tail = last_lines(os.path.join(run_dir, "logs", "torchrun.log"))
    return RunFailed(
        f"disk full: {full}. Writing the run's records failed and every rank was stopped"
        f"{' (' + where + ')' if where else ''}; what was recorded before loads with dtlab.load_run. "
        f"Free space there, or choose another `out`. Run directory: {run_dir}",
        rank=first["rank"] if first else None,
        error=f"disk full: {full}",
        traceback_tail=tail,
        run_dir=run_dir,
        run=run,
        state="failed",
        log_tail=tail,
    )


def _stall_failure(run_dir: str, run, stall: dict) -> RunFailed:
    rows = {row["rank"]: row for row in stall["rows"]}
    named = stall["ranks"]
    first = rows[named[0]]
    log_tail = last_lines(os.path.join(run_dir, "logs", f"rank{named[0]}.log"), 30)
    msg = (
        f"{stall_sentence(stall)} Each rank's Python stack is in its log. Run directory: {run_dir}\n"
        f"--- logs/rank{named[0]}.log (last lines) ---\n{log_tail or '(empty)'}"
    )
    return RunFailed(
        msg,
        rank=named[0],
        ranks=named,
        error=f"stalled: {first['where']}, silent {first['silent_s']:g} s",
        traceback_tail=first["stack"],
        run_dir=run_dir,
        run=run,
        state="stalled",
        signal="SIGSTOP" if first["frozen"] else None,
        log_tail=log_tail,
        silent_s={r: rows[r]["silent_s"] for r in named},
        consequences=[
            {
                "rank": r,
                "how": f"waiting: {row['where']}, silent {row['silent_s']:g} s",
                "error": None,
                "signal": None,
                "exitcode": None,
            }
            for r, row in rows.items()
            if r not in named
        ],
    )


def _stalled_elsewhere(node, frozen: bool) -> dict | None:
    """Multi-node: the status of another node whose watchdog stopped the run (with `frozen`, only one that found
    a frozen rank): what held up, or cut off, this node's ranks. None if no node says so."""
    for slot, st in sorted(node_statuses(node.run_dir).items()):
        if slot != node.slot and st.get("state") == "stalled" and st.get("frozen_ranks" if frozen else "stalled_ranks"):
            return {"slot": slot, **st}
    return None


def _blame_remote(local: RunFailed, remote: dict) -> RunFailed:
    """The RunFailed of a node whose ranks only waited on (or lost) a rank that another node's watchdog named."""
    named = remote.get("frozen_ranks") or remote["stalled_ranks"]
    frozen = bool(remote.get("frozen_ranks"))
    here = ", ".join(f"rank {c}" for c in local.ranks) or "no rank"
    msg = (
        f"rank {named[0]} stalled on node slot {remote['slot']}{': frozen (SIGSTOP)' if frozen else ''}, named by "
        f"that node's launcher ({_short_error(remote.get('error', ''), 300)}). On this node {here} only waited "
        f"on it or lost it: " + str(local)
    )
    return RunFailed(
        msg,
        rank=named[0],
        ranks=named,
        error=f"stalled on node slot {remote['slot']}",
        traceback_tail=local.traceback_tail,
        run_dir=local.run_dir,
        run=local.run,
        state=local.state,
        signal="SIGSTOP" if frozen else None,
        log_tail=local.log_tail,
        silent_s=local.silent_s,
        consequences=[
            {
                "rank": c,
                "how": "waited on, or lost, a rank of another node",
                "error": local.error,
                "signal": local.signal,
                "exitcode": local.exitcode,
            }
            for c in local.ranks
        ]
        + local.consequences,
    )


def stall_sentence(stall: dict) -> str:
    rows = {row["rank"]: row for row in stall["rows"]}
    limit = (
        f"stall_s={stall['stall_s']:g} s"
        if stall["stall_s"] is not None
        else f"derived limit {stall['threshold_s']:g} s"
    )
    parts = []
    for r in stall["ranks"]:
        row = rows[r]
        top = f"; stack top: {row['stack_top']}" if row["stack_top"] else "; no stack dump arrived"
        parts.append(
            f"rank {r} stalled: no event for {row['silent_s']:g} s ({limit}); "
            f"{'frozen (SIGSTOP); ' if row['frozen'] else ''}{row['where']}{top}"
        )
    s = ". ".join(parts) + "."
    if stall["why"] is None and len(stall["ranks"]) > 1:
        s += " Could not tell which of them holds up the others: compare their stacks."
    waiting = [row for r, row in rows.items() if r not in stall["ranks"]]
    if waiting:
        s += (
            " Waiting on it: "
            + "; ".join(f"rank {row['rank']} ({row['where']}, silent {row['silent_s']:g} s)" for row in waiting)
            + "."
        )
    return s


# How a rank ended, as a cause: lower class = more likely the cause.
#  0 died without recording an error (a signal other than SIGTERM, or a non-zero exit code): kill -9, the OOM
#    killer, a segfault, os._exit. Nothing a peer does makes a rank die like that.
#  1 recorded an error that is not a lost connection.
#  2 ended by SIGTERM without recording an error: usually torchrun stopping the survivors of a failure.
#  3 recorded a lost connection to a peer (gloo "Connection reset by peer", NCCL "remote process exited").
_PEER_LOST = re.compile(
    r"connection (reset|closed) by peer|broken pipe|socket closed|remote process exited|"
    r"connection refused|timed out|timeout|communicator was aborted|end of file|"
    r"distnetworkerror",
    re.IGNORECASE,
)
_SIGNAL_HINT = {
    "SIGKILL": "killed from outside: kill -9, or the kernel's out-of-memory killer (see dmesg)",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code",
    "SIGABRT": "an abort in native code",
    "SIGILL": "a crash in native code",
    "SIGFPE": "a crash in native code",
    "SIGTERM": "stopped (by torchrun after another rank failed, or from outside)",
    "SIGINT": "interrupted",
}


def _rank_outcomes(run_dir: str) -> list[dict]:
    """Every rank that ended badly, from its own error event and from torchrun's exit record."""
    exits = {}
    paths = sorted(glob.glob(os.path.join(run_dir, "exits.json"))) + sorted(
        glob.glob(os.path.join(run_dir, "nodes", "*.exits.json"))
    )
    for path in paths:
        try:  # one file per node in a multi-node job, keyed by global rank
            with open(path) as f:
                exits.update({int(k): v for k, v in json.load(f).items()})
        except (OSError, ValueError):
            continue
    errors, last = {}, {}
    for evs in _final_attempt(run_dir):
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
        o = {"rank": r, "exitcode": code, "signal": sig, "where": progress_of(last.get(r)), "on": _on(last, r)}
        if err is not None:
            o.update(
                error=err.get("error", ""),
                time=float(err.get("time") or 0),
                traceback_tail="\n".join(err.get("traceback", "").strip().splitlines()[-12:]),
                **{"class": 3 if _PEER_LOST.search(err.get("error", "")) else 1},
            )
        elif code:
            o.update(error=None, time=float(ex.get("timestamp") or 0), **{"class": 2 if sig == "SIGTERM" else 0})
        else:
            continue
        o["how"] = _how(o, short=True)
        out.append(o)
    return out


def _on(last: dict, rank: int) -> str:
    """' (node N, host H)' for a rank of a multi-node job (from its start event), '' otherwise."""
    starts = {r: evs[0] for r, evs in last.items() if evs and evs[0].get("kind") == "start"}
    if len({s.get("node") for s in starts.values()}) < 2 or rank not in starts:
        return ""
    return f" (node {starts[rank].get('node')}, host {starts[rank].get('host')})"


def crashed_after_done(run_dir: str, ranks) -> str | None:
    """A sentence naming the ranks that exited badly after recording `done` (a crash in process-group or
    interpreter shutdown, e.g. a backend thread aborting), when every one of `ranks` (an int n: ranks 0..n-1)
    recorded `done` and no rank recorded an error; None otherwise (the run really failed)."""
    ranks = set(range(ranks)) if isinstance(ranks, int) else set(ranks)
    done = set()
    for evs in _final_attempt(run_dir):
        for e in evs:
            if e.get("kind") == "error":
                return None
            if e.get("kind") == "done":
                done.add(e.get("rank"))
    if not ranks <= done:
        return None
    bad = [o for o in _rank_outcomes(run_dir) if o.get("exitcode")]
    named = "; ".join(f"rank {o['rank']} {_how(o, short=True)}" for o in bad) or "torchrun exited non-zero"
    return f"after the run finished, during shutdown: {named}."


def _short_error(err: str, limit: int) -> str:
    """One line: no source locations ("[/__w/.../pair.cc:537] "), cut at a sentence end past `limit`."""
    err = re.sub(r"\[/[^\]]*:\d+\]\s*", "", " ".join(err.split()))
    if len(err) > limit:
        cut = err.find(". ", limit // 2)
        err = err[: cut + 1] if 0 < cut <= limit else err[: limit - 3] + "..."
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
        return f"died from signal {o['signal']} (exit code {o['exitcode']}) without recording an error" + (
            f": {hint}" if hint else ""
        )
    return (
        f"exited with code {o['exitcode']} without recording an error (os._exit, or a crash before its "
        f"event file opened; see its log)"
    )


def progress_of(events: list | None) -> str:
    """Where a rank had got to, from its events: the last step it recorded (or that it had none yet)."""
    if not events:
        return ""
    prog = [e for e in events if e.get("kind") in PROGRESS_KINDS]
    if not prog:
        return f"before its first step (last event '{events[-1].get('kind')}')"
    e = prog[-1]
    if e.get("kind") == "baseline_step" and e.get("paired_step") is not None:  # run right after its paired step
        return f"after step {e['paired_step']} and its baseline step {e.get('step')}"
    if e.get("kind") in ("step", "baseline_step"):
        return f"after {'baseline ' if e['kind'] == 'baseline_step' else ''}step {e.get('step')}"
    return f"after {len(prog)} calibration events"


def _final_attempt(run_dir: str) -> list[list[dict]]:
    """Each rank's events of the run's last attempt (torchrun restarts the group: dtlab.results.restarts): what
    torchrun's exit record (exits.json) describes. Without restarts, all of them."""
    per_rank = [read_events(p) for p in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.jsonl")))]
    last = max((attempt_of(e) for evs in per_rank for e in evs), default=0)
    return [final_attempt_events(evs, last) for evs in per_rank]


def _last_events(run_dir: str) -> list[dict]:
    """Each rank's progress in words; with the innermost frame of its stack where the launcher dumped them at a
    timeout (status.json's stack_tops)."""
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            tops = json.load(f).get("stack_tops") or {}
    except (OSError, ValueError, AttributeError):
        tops = {}
    out = []
    for evs in _final_attempt(run_dir):
        if evs and "rank" in evs[0]:
            top = tops.get(str(evs[0]["rank"]))
            out.append({"rank": evs[0]["rank"], "where": progress_of(evs) + (f", at {top}" if top else "")})
    return out
