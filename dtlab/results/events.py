"""Reading a rank's event file (events/rank{r}.jsonl). Pure: the one parser every reader shares.

A rank writes one JSON object per line and flushes it (dtlab.rank.recorder.EventWriter), so a rank that dies
mid-write leaves at most one torn line: its file's last line, or (when torchrun restarted the rank, which then
appends) the line just before the restarted attempt's `start`. Those two are tolerated and counted. Anything
else is damage and is reported with the file, the line number and what is wrong, and the line is skipped:

- a line that is not JSON (a torn or overwritten line in the middle of the file);
- JSON that is not an object (`[1, 2, 3]`), or an object without a string `kind`;
- a known kind whose fields have the wrong type (`"step": "oops"`, `"rank": null`), checked against `SCHEMA`;
- an event of another rank than the file's name says.

`RankTail(path)` follows one file as it is written and applies these rules to each line once its newline has
arrived (every reader of event files goes through it); `scan_events(path)` returns a whole file's events with the
report; `read_events(path)` only the events (what the launcher's failure report needs while a run is still being
written).
"""

from __future__ import annotations

import json
import os
import re
import zlib
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
    nbytes: int = 0
    """Bytes read, their CRC-32 (`crc32`) and lines (`lines`): what a columnar copy of the events is checked
    against."""
    crc32: int = 0
    lines: int = 0

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
    """Read one rank's event file strictly (see the module docstring); `path` is named in every report. The file is
    followed to its end by a `RankTail`, which then closes it: the one set of rules every reader applies."""
    tail = RankTail(path)
    events = tail.read()
    events += tail.close()
    return EventScan(path, events, tail.torn, tail.damage, tail.offset, tail.crc32, tail.lines)


class RankTail:
    """One rank's event file, followed: `read()` returns the valid events completed since the last call, `close()`
    the rest once the writer has ended. The one follower of event files: the strict reader (`scan_events`), the
    live monitor (dtlab.results.live), the launcher's watchdog and the interrupter (dtlab.launching) all read
    through it, so a torn or damaged line means the same to each:

    - a line is parsed only when its newline has arrived: the bytes after the last newline are kept as `partial`
      and joined with what the next read finds (a read may land between the bytes of a line);
    - at `close()`, a partial line left over is torn (tolerated, counted in `torn`) unless it parses;
    - a complete line that is not JSON is torn only when the next line is a restarted attempt's `start`; any other
      bad line is skipped and reported in `damage` (file, line number, what), as are events `check_event` refuses.

    offset: bytes consumed, crc32: their CRC-32; lines: complete lines seen. Complete lines are parsed in batches of
    up to `BATCH` as one JSON array (one call into the decoder instead of one per line): a JSON string cannot hold
    a raw newline, so when every line of a batch opens with `{`, closes with `}` and the array has one object per
    line, each object is that line's; any other batch is read line by line. Either way the same events, torn
    lines and damage result."""

    BATCH = 4096

    def __init__(self, path: str):
        self.path, self.rank = path, file_rank(path)
        self.offset, self.partial, self.lines, self.crc32 = 0, b"", 0, 0
        self.torn: list[int] = []
        self.damage: list[dict] = []
        self.attempt = 0
        self._pending: tuple[int, str] | None = None  # an unparsable line: torn only if a restart follows it
        self.closed = False

    def read(self) -> list[dict]:
        """The valid events whose lines were completed since the last read (none once `close()` was called)."""
        if self.closed or not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        if not data:
            return []
        self.crc32 = zlib.crc32(data, self.crc32)
        *complete, self.partial = (self.partial + data).split(b"\n") if self.partial else data.split(b"\n")
        out: list[dict] = []
        for i in range(0, len(complete), self.BATCH):
            self._batch(complete[i : i + self.BATCH], out)
        return out

    def _batch(self, lines: list, out: list) -> None:
        if self._pending is not None and lines:  # the line after an unparsable one decides what that one was
            self.lines += 1
            ev = self._line(self.lines, lines[0])
            out += [ev] if ev is not None else []
            lines = lines[1:]
        parsed = _parse_batch(lines) if len(lines) > 1 else None
        if parsed is None:
            for raw in lines:
                self.lines += 1
                ev = self._line(self.lines, raw)
                if ev is not None:
                    out.append(ev)
            return
        rank, attempt = self.rank, self.attempt
        for ev in parsed:
            self.lines += 1
            if not _valid(ev, rank):
                self._damaged(self.lines, check_event(ev, rank))
                continue
            a = ev.get("attempt")
            if a and a > attempt:
                attempt = a
            out.append(ev)
        self.attempt = attempt

    def _line(self, n: int, raw: bytes, last: bool = False) -> dict | None:
        if not raw.strip():
            if self._pending is None:
                self._damaged(n, "an empty line")
            return None
        ev, why = parse_line(raw)
        if self._pending is not None:
            restarted = isinstance(ev, dict) and ev.get("kind") == "start" and _later(ev, self.attempt)
            (self.torn.append(self._pending[0]) if restarted else self._damaged(*self._pending))
            self._pending = None
        if why is not None:
            if last:  # the writer died mid-line
                self.torn.append(n)
            else:
                self._pending = (n, f"{why}: a torn or corrupted line inside the file")
            return None
        bad = check_event(ev, self.rank)
        if bad is not None:
            self._damaged(n, bad)
            return None
        self.attempt = max(self.attempt, int(ev.get("attempt") or 0))
        return ev

    def _damaged(self, line: int, what: str) -> None:
        self.damage.append({"file": self.path, "line": line, "what": what})

    def close(self) -> list[dict]:
        """The writer has ended: read what is left; a partial last line is a torn line (tolerated, counted) and an
        unparsable line that no restart followed is damage. Returns the last events."""
        out = self.read()
        if self.partial:  # a last line without its newline: an event if it parses, else torn
            self.lines += 1
            ev = self._line(self.lines, self.partial, last=True)
            out += [ev] if ev is not None else []
            self.partial = b""
        if self._pending is not None:
            self._damaged(*self._pending)
            self._pending = None
        self.closed = True
        return out


def _parse_batch(lines: list) -> list | None:
    """Every line's object, parsed as one JSON array, or None when the batch must be read line by line."""
    for raw in lines:
        if raw[:1] != b"{" or raw[-1:] != b"}":
            return None
    try:
        parsed = json.loads(b"[" + b",".join(lines) + b"]")
    except ValueError:
        return None
    if len(parsed) != len(lines) or not all(type(ev) is dict for ev in parsed):
        return None
    return parsed


_TYPES = {INT: (int,), NUM: (int, float), STR: (str,)}
#: SCHEMA as (field, the Python types JSON gives a valid value, may not be null), for the quick check
_QUICK = {k: tuple((n, _TYPES[t], req) for n, (t, req) in spec.items()) for k, spec in SCHEMA.items()}


def _valid(ev: dict, rank: int | None) -> bool:
    """check_event(ev, rank) is None, quickly for the kinds of SCHEMA (bool is not int here: JSON's true is a bool)."""
    kind = ev.get("kind")
    spec = _QUICK.get(kind) if type(kind) is str else None
    if spec is None:
        return check_event(ev, rank) is None
    for name, types, req in spec:
        v = ev.get(name)
        if v is None:
            if req and name in ev:
                return False
        elif type(v) not in types:
            return False
    a = ev.get("attempt")
    if a is not None and type(a) is not int:
        return False
    return rank is None or type(ev.get("rank")) is not int or ev["rank"] == rank


def _later(ev: dict, attempt: int) -> bool:
    return isinstance(ev.get("attempt"), int) and ev["attempt"] > attempt


def read_events(path: str) -> list[dict]:
    """The valid events of one rank's file, in order (torn and damaged lines skipped; see `scan_events` for the
    report of what was skipped)."""
    return scan_events(path).events
