"""The one strict reader of a run directory (training runs, calibrations, exercises): what `load_run` and
`load_calibration` build on. Pure: no torch, no processes started.

What it promises (docs/faults.md):

- config.json: read whole or not at all: garbage, or no config object, is a `DamagedRun` naming the file, the
  line and column and what is wrong (a run whose config is unknown cannot be read honestly).
- events/: must exist (it is created before config.json); each rank file is read by dtlab.results.events.scan_events:
  a torn last line is tolerated and counted, any other damaged line is skipped and reported (file, line, what)
  as a warning.
- status.json: damaged or missing is recoverable: reported as a warning, the state is then taken from the
  events (every rank recorded `done`: finished; an error: failed; otherwise unknown). A status that says
  'running' whose launcher and torchrun agent are gone (dtlab.results.liveness) is reported as 'abandoned', saying so.
- `RunFailed`: what a run that did not finish reports (raised by the launcher, and by loaders of runs that must
  have finished, such as a calibration's profile: `require_finished`).
- Completeness: a run whose status says finished but where a rank's events end without `done` (its file cut
  short, or missing) is reported as 'incomplete', naming the rank and where its events end beside its peers'.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

from dtlab.results.events import EventScan, file_rank, scan_events
from dtlab.results.liveness import running_state
from dtlab.results.restarts import final_attempt_events
from dtlab.results.upgrade import upgrade_doc, upgrade_event
from dtlab.runfiles import DamagedRun, read_json

EXAMPLES = 3  # damaged lines quoted per file in a warning


class RunFailed(RuntimeError):
    """A run that did not finish. The message is one paragraph (who, how, where) plus the culprit's log tail.

    - `state`: 'failed' (a rank ended on its own), 'stalled' (the watchdog stopped it), 'timeout',
      'interrupted' or 'stopped'.
    - `rank`: the rank that caused it (for a stall, the first of `ranks`); None when no rank can be named.
      `ranks`: every rank named as a cause (several when the watchdog cannot tell which one holds the others).
    - `signal` ('SIGKILL', 'SIGSEGV', 'SIGSTOP' for a frozen rank, ...) and `exitcode` (negative for a signal,
      as torchrun reports it): how the culprit ended; None when it recorded an error or is still running.
    - `error`: the culprit's recorded error ("RuntimeError: ..."), or a sentence when it recorded none.
    - `consequences`: the other ranks that failed only because the culprit vanished, one dict each (rank,
      how, error, signal, exitcode): reported, never blamed.
    - `silent_s`: for a stall, how long each named rank had been silent ({rank: seconds}).
    - `traceback_tail` (the culprit's traceback, when it raised), `log_tail` (the end of its log, with its
      Python stack for a stall), `run` (a partial `Run` of everything recorded), `run_dir`.
    """

    def __init__(
        self,
        message: str,
        *,
        rank=None,
        error=None,
        traceback_tail=None,
        run_dir=None,
        run=None,
        state=None,
        ranks=None,
        signal=None,
        exitcode=None,
        consequences=None,
        log_tail=None,
        silent_s=None,
    ):
        super().__init__(message)
        self.rank, self.error, self.traceback_tail = rank, error, traceback_tail
        self.run_dir, self.run = run_dir, run
        self.state = state
        self.ranks = list(ranks) if ranks is not None else ([rank] if rank is not None else [])
        self.signal, self.exitcode = signal, exitcode
        self.consequences = list(consequences or [])
        self.log_tail = log_tail
        self.silent_s = dict(silent_s or {})


@dataclass
class RunRecord:
    """What a run directory holds, read strictly: config.json's document (its config in the current form:
    dtlab.results.upgrade), the effective status, every rank file's scan, and the warnings a reader should see."""

    path: str
    doc: dict
    status: dict
    scans: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    ended: dict = field(default_factory=dict)
    """rank -> 'done', 'error' or 'incomplete' (its final attempt's events end without either)."""
    version: int = 1
    """The config form the run was recorded in (`config_version`; 1 before it was recorded)."""
    where: dict = field(default_factory=dict)
    """rank -> where its final attempt's events end ('ends after step 41'), for a run cut short."""

    def events(self):
        """Every valid event of every rank file, file by file, in the current form (dtlab.results.upgrade)."""
        for scan in self.scans:
            for ev in scan.events:
                yield upgrade_event(ev, self.version)

    def damage(self) -> list[dict]:
        """One dict per line that was skipped or tolerated: file (relative), line, what, tolerated."""
        out = []
        for s in self.scans:
            rel = os.path.relpath(s.path, self.path)
            out += [
                {"file": rel, "line": n, "what": "torn last line (a write cut off)", "tolerated": True} for n in s.torn
            ]
            out += [{**d, "file": rel, "tolerated": False} for d in s.damage]
        return out


def expected_ranks(doc: dict, key: str) -> int | None:
    """World size of the run: what rank 0 resolved, else nproc x nnodes from the config; None if unknown."""
    ws = doc.get("resolved", {}).get("world_size") if isinstance(doc.get("resolved"), dict) else None
    if isinstance(ws, int) and ws > 0:
        return ws
    body = doc.get(key, {})
    n, k = body.get("nproc"), body.get("nnodes") or 1
    return n * k if isinstance(n, int) and isinstance(k, int) else None


def read_run_dir(path: str, key: str = "config", on_scan=None) -> RunRecord:
    """Read run directory `path` strictly (see the module docstring). `key`: the object config.json must hold
    ('config' for training runs, 'calibration' for sweeps). `on_scan(rec, scan)`: given each rank file's scan in turn,
    whose events are then let go (`rec.events()` is empty): a long run's events need not all be in memory at once."""
    doc, version = read_doc(path, key)
    ev_dir = os.path.join(path, "events")
    if not os.path.isdir(ev_dir):
        raise DamagedRun(
            ev_dir,
            "the events folder is missing: it is created before config.json, so the run "
            "directory was damaged (or copied without it); nothing the ranks recorded is left",
        )
    rec = RunRecord(path, doc, {}, version=version)
    for p in event_files(path):
        scan = scan_events(p)
        rec.scans.append(scan)
        if scan.damage:
            rec.warnings.append(_damage_sentence(os.path.relpath(scan.path, path), scan))
        r = file_rank(scan.path)
        if r is not None:
            final = final_attempt_events(scan.events)
            kinds = {e.get("kind") for e in final}
            rec.ended[r] = "error" if "error" in kinds else "done" if "done" in kinds else "incomplete"
            rec.where[r] = _where(final)
        if on_scan is not None:
            on_scan(rec, scan)
            scan.events = []
    rec.status = _status(rec, key)
    return rec


def read_doc(path: str, key: str = "config") -> tuple[dict, int]:
    """(config.json's document with its `key` object in the current form, the version it was recorded in); a
    missing config.json is a FileNotFoundError, one that cannot be read or holds no `key` object a DamagedRun."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path} is not a dtlab run directory (no config.json)")
    doc = read_json(cfg_path)
    if not isinstance(doc.get(key), dict):
        raise DamagedRun(
            cfg_path,
            f"no {key!r} object: not the record of a "
            + ("training run" if key == "config" else "calibration")
            + " (or a damaged one)",
        )
    try:
        return upgrade_doc(doc, key)
    except ValueError as e:
        raise DamagedRun(cfg_path, str(e)) from None


def event_files(path: str) -> list[str]:
    """The rank files of run directory `path` (events/rank*.jsonl), in rank order."""
    return sorted(
        glob.glob(os.path.join(path, "events", "rank*.jsonl")), key=lambda p: (file_rank(p) is None, file_rank(p) or 0)
    )


def settle_status(rec: RunRecord, key: str = "config") -> None:
    """Set `rec.status` from status.json, the ranks' ends and whether the launcher still runs (a record whose
    scans were read before: dtlab.results.columns)."""
    rec.status = _status(rec, key)


def _damage_sentence(rel: str, scan: EventScan) -> str:
    shown = "; ".join(f"line {d['line']}: {d['what']}" for d in scan.damage[:EXAMPLES])
    more = f" (and {len(scan.damage) - EXAMPLES} more)" if len(scan.damage) > EXAMPLES else ""
    return f"{rel}: {len(scan.damage)} damaged line(s) skipped: {shown}{more}"


def _where(final: list) -> str:
    steps = [e["step"] for e in final if e.get("kind") in ("step", "baseline_step")]
    return f"ends after step {max(steps)}" if steps else "ends before its first step"


def _status(rec: RunRecord, key: str) -> dict:
    body = rec.doc[key]
    nnodes = body.get("nnodes") if isinstance(body.get("nnodes"), int) else 1
    if nnodes > 1 and os.path.isdir(os.path.join(rec.path, "nodes")):  # each node reports on its own
        problems: list = []
        status = merged_status(rec.path, nnodes, problems)
        rec.warnings += problems
    else:
        status = _single_status(rec, key)
    if status.get("state") == "running":
        found = running_state(status, rec.path)
        if found and "state" in found:
            inferred = "finished" if _all_done(rec, key) else "abandoned"
            status = {**status, "state": inferred, "recorded_state": "running", "why": found["why"]}
        elif found:
            status = {**status, "note": found["note"]}
    if status.get("state") == "finished" and not _all_done(rec, key):
        status = {**status, "state": "incomplete", "recorded_state": status.get("recorded_state", "finished")}
        rec.warnings.append(_incomplete_sentence(rec, key))
    return status


def recorded_status(run_dir: str, nnodes: int = 1) -> tuple[dict | None, str]:
    """What the launcher(s) recorded in status.json, as written (no liveness check): (status, '') or (None, why
    it cannot be read). A multi-node run's nodes each report on their own and are merged (`merged_status`).
    The one reader of status.json: `read_run_dir`, replay and sweeps all go through it."""
    if nnodes > 1 and os.path.isdir(os.path.join(run_dir, "nodes")):
        return merged_status(run_dir, nnodes), ""
    path = os.path.join(run_dir, "status.json")
    if not os.path.exists(path):
        return None, "no status.json (the launcher recorded no state)"
    try:
        status = read_json(path)
    except (DamagedRun, OSError) as e:
        return None, str(e)
    if not isinstance(status.get("state"), str):
        return None, f"{path}: no 'state' (got {status.get('state')!r})"
    return status, ""


def _single_status(rec: RunRecord, key: str) -> dict:
    status, why = recorded_status(rec.path)
    if status is not None:
        return status
    errors = any(v == "error" for v in rec.ended.values())
    state = "failed" if errors else "finished" if _all_done(rec, key) else "unknown"
    rec.warnings.append(f"{why}; the state was read from the ranks' events instead: {state}")
    return {"state": state, "damaged": why}


def _all_done(rec: RunRecord, key: str) -> bool:
    """Every rank of the run (world size, else every rank file) recorded `done` in its final attempt."""
    n = expected_ranks(rec.doc, key)
    ranks = range(n) if n else sorted(rec.ended)
    return bool(list(ranks)) and all(rec.ended.get(r) == "done" for r in ranks)


def _incomplete_sentence(rec: RunRecord, key: str) -> str:
    n = expected_ranks(rec.doc, key) or len(rec.ended)
    short = [r for r in range(n) if rec.ended.get(r) != "done"]
    done = [r for r in range(n) if rec.ended.get(r) == "done"]
    peers = "; ".join(f"rank {r} {rec.where[r]} with `done`" for r in done[:EXAMPLES])
    return (
        "status.json says finished, but "
        + "; ".join(
            f"rank {r} {rec.where[r]} without `done`" if r in rec.where else f"rank {r} has no event file"
            for r in short
        )
        + (f" (peers: {peers})" if peers else "")
        + ": its events are cut short or lost, so the run is marked incomplete"
    )


def status_lines(run) -> list[str]:
    """Lines for the breakdown table when the state needs words: why it is not what status.json says (abandoned,
    incomplete, a damaged status), what was recorded before a run ended without finishing, and each warning."""
    st, out = run.status, []
    why = st.get("why") or st.get("note") or st.get("damaged") or st.get("disk")
    if why:
        out.append(
            f"  status: {st.get('state')}"
            + (f" (status.json says {st['recorded_state']})" if st.get("recorded_state") else "")
            + f": {why}"
        )
    if st.get("state") not in ("finished", "running"):
        steps = run.steps.groupby("rank")["step"].max() if not run.steps.empty else {}
        upto = "; ".join(f"rank {r} up to step {s}" for r, s in dict(steps).items())
        out.append(f"  recorded: {len(run.steps)} steps" + (f" ({upto})" if upto else ""))
    return out + [f"  warning: {w}" for w in run.warnings]


def require_finished(rec: RunRecord, what: str, run=None, hint: str = "") -> None:
    """Raise RunFailed (with its `state`, and `run`: what was recorded) unless the run in `rec` finished; used by
    loaders whose result only exists for a finished run (a calibration's profile). `what` names the run."""
    st = rec.status
    state = st.get("state") or "unknown"
    if state == "finished":
        return
    why = st.get("why") or st.get("damaged") or st.get("error") or ""
    how = {
        "running": "is still running",
        "interrupted": "was interrupted",
        "stopped": "was stopped",
        "abandoned": "was abandoned",
        "timeout": "ran past its timeout",
        "stalled": "was stopped by the watchdog",
        "incomplete": "is incomplete",
    }.get(state, f"ended {state}")
    raise RunFailed(
        f"{what} in {rec.path} {how} before it finished{': ' + why if why else ''}. {hint}".strip(),
        error=state,
        run_dir=rec.path,
        run=run,
        state=state,
    )


def sweep_progress(rec: RunRecord) -> str:
    """How far a calibration sweep got: 'N rank samples recorded, R of T rounds done'."""
    samples = sum(e.get("kind") == "sample" for e in rec.events())
    rounds = max([e["round"] + 1 for e in rec.events() if e.get("kind") == "calib"], default=0)
    return f"{samples} rank samples recorded, {rounds} of {rec.doc['calibration'].get('rounds')} rounds done"


#: How the per-node states combine into the run's: the first state in this order that any node is in.
_STATE_ORDER = ("failed", "stalled", "timeout", "interrupted", "stopped", "abandoned", "running", "finished")


def node_statuses(run_dir: str, problems: list | None = None) -> dict[int, dict]:
    """{slot: that node's status.json} for every node of a multi-node run directory that wrote one. A damaged
    file is left out and, given `problems`, described there (file, line, what is wrong)."""

    out = {}
    for p in sorted(glob.glob(os.path.join(run_dir, "nodes", "node*.status.json"))):
        m = re.search(r"node(\d+)\.status\.json$", p)
        try:
            out[int(m.group(1))] = read_json(p)
        except (OSError, DamagedRun) as e:
            if problems is not None:
                problems.append(f"{e}; that node's state is unknown")
    return out


def merged_status(run_dir: str, nnodes: int, problems: list | None = None) -> dict:
    """The status of a multi-node run: 'finished' once every node finished; otherwise the worst node state
    ('running' while a node has not reported). `nodes` holds each node's own status by slot. A node whose status
    says running while its launcher and agent are gone (checked on their host: dtlab.results.liveness) is
    'abandoned'."""

    per = node_statuses(run_dir, problems)
    for k, st in per.items():
        found = running_state(st, run_dir) if st.get("state") == "running" else None
        if found and "state" in found:
            per[k] = {**st, "state": "abandoned", "recorded_state": "running", "why": found["why"]}
    states = [per.get(k, {}).get("state", "running") for k in range(nnodes)]
    state = next(s for s in _STATE_ORDER + tuple(states) if s in states)
    merged = {"state": state, "nodes": {str(k): v for k, v in sorted(per.items())}}
    why = [f"node slot {k}: {v['why']}" for k, v in sorted(per.items()) if v.get("why")]
    return {**merged, "why": "; ".join(why)} if why else merged
