"""Reading a rank's event file (events/rank{r}.jsonl). Pure: the one parser every reader shares.

A rank writes one JSON object per line and flushes it (dtlab.rank.recorder.EventWriter), so a rank that dies
mid-write leaves at most one torn line: its file's last line, or (when torchrun restarted the rank, which then
appends) the line just before the restarted attempt's `start`. Those two are tolerated and counted. Anything
else is damage and is reported with the file, the line number and what is wrong, and the line is skipped:

- a line that is not JSON (a torn or overwritten line in the middle of the file);
- JSON that is not an object (`[1, 2, 3]`), or an object without a string `kind`;
- a known kind whose fields have the wrong type (`"step": "oops"`, `"rank": null`), checked against `SCHEMA`;
- an event of another rank than the file's name says.

`scan_events(path)` returns the events with the report; `read_events(path)` only the events (what the
launcher's watchdog and failure report need while a run is still being written).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

INT, NUM, STR = "an integer", "a number", "a string"
_REQ, _OPT = True, False  # a field that may not be null, or one that may (any field may be absent)

_STEP = {
    "rank": (INT, _REQ),
    "step": (INT, _REQ),
    "t_fwd": (NUM, _REQ),
    "t_bwd": (NUM, _REQ),
    "t_opt": (NUM, _REQ),
    "t_step": (NUM, _REQ),
    "loss": (NUM, _OPT),
}
#: Field types of the kinds dtlab's ranks write: {kind: {field: (type, never null)}}; a field may be absent (the
#: readers get lines through dtlab.results.upgrade, which fills in what an earlier form lacks). Other fields and
#: other kinds (course exercises write their own) are kept as they are: only `kind` (a string) and `rank` (an
#: integer, where present) are checked for those.
SCHEMA = {
    "start": {"rank": (INT, _REQ), "pid": (INT, _REQ), "world_size": (INT, _OPT)},
    "done": {"rank": (INT, _REQ)},
    "error": {"rank": (INT, _REQ), "error": (STR, _REQ)},
    "step": _STEP,
    "baseline_step": {**_STEP, "paired_step": (INT, _OPT)},  # null: unpaired
    "bucket": {
        "rank": (INT, _REQ),
        "step": (INT, _REQ),
        "bucket": (INT, _REQ),
        "nbytes": (INT, _REQ),
        "t_ready": (NUM, _OPT),
        "t_start": (NUM, _OPT),
        "t_end": (NUM, _OPT),
    },
    "collective": {
        "rank": (INT, _REQ),
        "step": (INT, _OPT),
        "nbytes": (INT, _REQ),
        "t_start": (NUM, _OPT),
        "t_end": (NUM, _OPT),
    },
    "blocked": {"rank": (INT, _REQ), "step": (INT, _OPT), "t_start": (NUM, _OPT), "t_end": (NUM, _OPT)},
    "memory": {
        "rank": (INT, _REQ),
        "params_bytes": (INT, _OPT),
        "grads_bytes": (INT, _OPT),
        "opt_bytes": (INT, _OPT),
        "peak_bytes": (INT, _OPT),
    },
    "ddp_stats": {"rank": (INT, _REQ), "step": (INT, _REQ)},
    "checkpoint": {"rank": (INT, _REQ), "step": (INT, _REQ), "t_save": (NUM, _OPT), "nbytes": (INT, _OPT)},
    "restart": {"rank": (INT, _REQ), "resumed_from": (INT, _OPT)},
    "sample": {
        "rank": (INT, _REQ),
        "op": (STR, _REQ),
        "nbytes": (INT, _REQ),
        "nproc": (INT, _REQ),
        "iter": (INT, _REQ),
        "seconds": (NUM, _REQ),
        "load": (STR, _OPT),
    },
    "load_done": {"rank": (INT, _REQ), "passes": (INT, _OPT)},
    "load_pass": {
        "rank": (INT, _REQ),
        "round": (INT, _OPT),
        "passes": (INT, _OPT),
        "left": (INT, _OPT),
        "seconds": (NUM, _OPT),
        "waited": (NUM, _OPT),
        "in_flight": (NUM, _OPT),
    },
    "calib": {"rank": (INT, _REQ), "round": (INT, _REQ), "rounds": (INT, _REQ)},
    "microbatch": {
        "rank": (INT, _REQ),
        "step": (INT, _REQ),
        "stage": (INT, _REQ),
        "microbatch": (INT, _REQ),
        "phase": (STR, _REQ),
        "t_start": (NUM, _REQ),
        "t_end": (NUM, _REQ),
    },
    "reference": {
        "rank": (INT, _REQ),
        "step": (INT, _REQ),
        "ref_loss": (NUM, _REQ),
        "loss": (NUM, _OPT),
        "grad_ratio": (NUM, _OPT),
        "grad_rel_err": (NUM, _OPT),
        "params_compared": (INT, _OPT),
    },
    "eval": {
        "rank": (INT, _REQ),
        "step": (INT, _REQ),
        "t": (NUM, _REQ),
        "accuracy": (NUM, _REQ),
        "loss": (NUM, _OPT),
        "t_eval": (NUM, _OPT),
    },
    "update": {
        "rank": (INT, _REQ),
        "worker": (INT, _REQ),
        "step": (INT, _REQ),
        "staleness": (INT, _REQ),
        "version": (INT, _REQ),
        "t": (NUM, _OPT),
    },
    "params": {"rank": (INT, _REQ), "step": (INT, _REQ), "digest": (STR, _REQ)},
    "machine": {"rank": (INT, _REQ), "phase": (STR, _REQ), "time": (NUM, _REQ), "cpu_s": (NUM, _REQ)},
}


@dataclass
class EventScan:
    """One event file read strictly: the good events, torn lines tolerated, and the damage found.

    `torn`: line numbers of tolerated torn lines (the last line, or the last line of an attempt that torchrun
    restarted). `damage`: one dict per skipped line: file, line (1-based), what (a sentence)."""

    path: str
    events: list = field(default_factory=list)
    torn: list = field(default_factory=list)
    damage: list = field(default_factory=list)

    def damaged(self, line: int, what: str) -> None:
        """Record that `line` was skipped because of `what`."""
        self.damage.append({"file": self.path, "line": line, "what": what})


def _type_ok(value, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    return {INT: isinstance(value, int), NUM: isinstance(value, (int, float)), STR: isinstance(value, str)}[kind]


def check_event(ev, rank: int | None = None) -> str | None:
    """Why `ev` (a parsed line) is not a valid event, or None when it is. `rank`: the rank the file belongs to."""
    if not isinstance(ev, dict):
        return f"a JSON {type(ev).__name__.replace('dict', 'object').replace('list', 'array')}, not an event object"
    kind = ev.get("kind")
    if not isinstance(kind, str):
        return f"no event kind (field 'kind' must be a string, got {kind!r})"
    spec = SCHEMA.get(kind, {"rank": (INT, _OPT)})
    for name, (typ, not_null) in spec.items():
        value = ev.get(name)
        if value is None:
            if not_null and name in ev:
                return f"{kind!r} event: field {name!r} must be {typ}, got null"
            continue
        if not _type_ok(value, typ):
            return f"{kind!r} event: field {name!r} must be {typ}, got {value!r}"
    if "attempt" in ev and ev["attempt"] is not None and not _type_ok(ev["attempt"], INT):
        return f"{kind!r} event: field 'attempt' must be an integer, got {ev['attempt']!r}"
    if rank is not None and isinstance(ev.get("rank"), int) and ev["rank"] != rank:
        return f"an event of rank {ev['rank']} in rank {rank}'s file"
    return None


def parse_line(raw: bytes) -> tuple[object, str | None]:
    """(parsed JSON, None) or (None, why it is not JSON)."""
    try:
        return json.loads(raw), None
    except ValueError as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        col = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        return None, f"not JSON ({why}{col})"


def file_rank(path: str) -> int | None:
    """The rank an event file is named after (events/rank3.jsonl -> 3), None for another name."""
    m = re.fullmatch(r"rank(\d+)\.jsonl", os.path.basename(path))
    return int(m.group(1)) if m else None


def scan_events(path: str) -> EventScan:
    """Read one rank's event file strictly (see the module docstring); `path` is named in every report."""
    scan, rank = EventScan(path), file_rank(path)
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    ends_cleanly = lines[-1] == b""
    if ends_cleanly:
        lines.pop()
    pending = None  # (line number, why) of an unparsable line: torn only if a restarted attempt follows it
    attempt = 0
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            if pending is None:
                scan.damaged(i, "an empty line")
            continue
        ev, why = parse_line(raw)
        if pending is not None:
            restarted = isinstance(ev, dict) and ev.get("kind") == "start" and _later(ev, attempt)
            (scan.torn.append(pending[0]) if restarted else scan.damaged(*pending))
            pending = None
        if why is not None:
            last = i == len(lines)
            if last and not ends_cleanly:
                scan.torn.append(i)  # the writer died mid-line
            else:
                pending = (i, f"{why}: a torn or corrupted line inside the file")
            continue
        bad = check_event(ev, rank)
        if bad is not None:
            scan.damaged(i, bad)
            continue
        attempt = max(attempt, int(ev.get("attempt") or 0))
        scan.events.append(ev)
    if pending is not None:
        scan.damaged(*pending)
    return scan


def _later(ev: dict, attempt: int) -> bool:
    return isinstance(ev.get("attempt"), int) and ev["attempt"] > attempt


def read_events(path: str) -> list[dict]:
    """The valid events of one rank's file, in order (torn and damaged lines skipped; see `scan_events` for the
    report of what was skipped)."""
    return scan_events(path).events
