"""Stream one PyTorch profiler (Kineto) trace file into columns, without holding its events as Python objects.

A trace is one JSON object whose `traceEvents` array holds every event; the other keys (distributedInfo,
deviceProperties, baseTimeNanoseconds, ...) are small. The array is read one event at a time with the json
module's own C decoder on a sliding text buffer; each event is reduced to a few numbers appended to
`array.array` columns (device activity, runtime launches) or, for the few events that matter one by one (the
profiler's steps, collective annotations and collective kernels), to a short tuple. Memory is the columns plus
one buffer, whatever the file size. `.json.gz` is decompressed on the fly.

Timestamps are microseconds in the file (integers in older traces, floats in newer ones); they stay in
microseconds here. Pure: no torch.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from array import array
from dataclasses import dataclass, field

CHUNK = 1 << 20  # characters read per refill

#: event category -> what it is: device activity (kernels, copies, sets), a runtime launch, a CPU operation
DEVICE, RUNTIME, CPU = 1, 2, 3
CATEGORIES = {
    "kernel": DEVICE,
    "Kernel": DEVICE,
    "gpu_memcpy": DEVICE,
    "Memcpy": DEVICE,
    "gpu_memset": DEVICE,
    "Memset": DEVICE,
    "cuda_runtime": RUNTIME,
    "Runtime": RUNTIME,
    "cuda_driver": RUNTIME,
    "cpu_op": CPU,
    "Operator": CPU,
    "user_annotation": CPU,
}
#: CPU-side names that carry a collective's metadata (the annotation that launched it, or gloo's own span)
_COMM_CPU = re.compile(r"^(nccl:|gloo:|record_param_comms$|c10d::)")
_WS = re.compile(r"\s*").match
#: kernel argument keys kept for collectives (new layouts put the collective's metadata on the kernel itself)
_META_KEYS = (
    "Collective name",
    "In msg nelems",
    "Out msg nelems",
    "Group size",
    "dtype",
    "Process Group Name",
    "Process Group Description",
    "Process Group Ranks",
    "Seq",
    "seq",
    "Input Dims",
    "Input type",
)


class TraceDamaged(ValueError):
    """A trace file that cannot be read: truncated or not valid JSON. The message names the file and the position
    (character offset and line in the decompressed text)."""


@dataclass
class RankColumns:
    """What one trace file holds, as columns (times in microseconds, as in the file).

    dev_*: device activity (kernels, memcpy, memset): name id into `names`, start, duration, stream, correlation.
    rt_*: runtime launches (cudaLaunchKernel, ...): correlation, CPU thread, start.
    cpu_*: CPU operations (name id, thread, start, duration), used for CPU-only traces' compute.
    steps: (number, start, duration) of each ProfilerStep#N. comm_cpu: (name, thread, start, duration, args) of
    collective annotations (nccl:*, gloo:*, record_param_comms, c10d::*). comm_dev: {device row: args} of
    collective kernels' metadata. info: the file's top-level keys other than traceEvents."""

    path: str
    names: list = field(default_factory=list)
    dev_name: array = field(default_factory=lambda: array("i"))
    dev_ts: array = field(default_factory=lambda: array("d"))
    dev_dur: array = field(default_factory=lambda: array("d"))
    dev_stream: array = field(default_factory=lambda: array("q"))
    dev_corr: array = field(default_factory=lambda: array("q"))
    rt_corr: array = field(default_factory=lambda: array("q"))
    rt_tid: array = field(default_factory=lambda: array("q"))
    rt_ts: array = field(default_factory=lambda: array("d"))
    cpu_name: array = field(default_factory=lambda: array("i"))
    cpu_tid: array = field(default_factory=lambda: array("q"))
    cpu_ts: array = field(default_factory=lambda: array("d"))
    cpu_dur: array = field(default_factory=lambda: array("d"))
    steps: list = field(default_factory=list)
    comm_cpu: list = field(default_factory=list)
    comm_dev: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    n_events: int = 0
    chars: int = 0


def _int(x, default: int = -1) -> int:
    """A thread or stream id as an int (traces use ints; a few write strings)."""
    if isinstance(x, int):
        return x
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


class _Text:
    """A sliding window over the decompressed text, with the absolute position of its start for error messages."""

    def __init__(self, f, path: str):
        self.f, self.path = f, path
        self.buf, self.base, self.lines, self.eof = "", 0, 1, False

    def refill(self, pos: int) -> int:
        """Drop buf[:pos], append the next chunk; returns the new position of `pos` (0)."""
        try:
            chunk = self.f.read(CHUNK)
        except (EOFError, zlib.error, gzip.BadGzipFile, OSError, UnicodeDecodeError) as e:
            raise self.damaged(pos, f"the compressed stream is cut or damaged ({e})") from None
        self.lines += self.buf.count("\n", 0, pos)
        self.base += pos
        self.buf = self.buf[pos:] + chunk
        self.eof = not chunk
        return 0

    def damaged(self, pos: int, why: str) -> TraceDamaged:
        line = self.lines + self.buf.count("\n", 0, min(pos, len(self.buf)))
        return TraceDamaged(
            f"{self.path}: {why} at character {self.base + pos:,} (line {line:,}); the file is not a complete trace"
        )


_decode = json.JSONDecoder().raw_decode


def _maybe_cut(buf: str, err: json.JSONDecodeError) -> bool:
    """Whether a decode error may only be the window's end cutting a value (more text may complete it): an
    unterminated string, or an error within the last characters of the window, e.g. a number cut after its '.'
    or 'e', a 'tru' cut from 'true'. A real error is found again once the window holds more text after it."""
    return err.msg.startswith("Unterminated") or len(buf) - err.pos < 64


def _value(t: _Text, pos: int):
    """Decode the JSON value at `pos`, reading more text as needed; returns (value, end)."""
    while True:
        pos = _WS(t.buf, pos).end()
        if pos >= len(t.buf) and not t.eof:
            pos = t.refill(pos)
            continue
        try:
            v, end = _decode(t.buf, pos)
            if end < len(t.buf) or t.eof:  # a number at the very end of the buffer may go on in the next chunk
                return v, end
        except json.JSONDecodeError as e:
            if t.eof:
                raise t.damaged(
                    e.pos, "truncated" if not t.buf[e.pos :].strip() else f"not valid JSON ({e.msg})"
                ) from None
            if not _maybe_cut(t.buf, e):
                raise t.damaged(e.pos, f"not valid JSON ({e.msg})") from None
        pos = t.refill(pos)


def _skip(t: _Text, pos: int, allowed: str) -> tuple[int, str]:
    """Skip whitespace; returns (position, the next character) when it is one of `allowed`, else raises."""
    while True:
        while pos < len(t.buf) and t.buf[pos] in " \t\r\n":
            pos += 1
        if pos < len(t.buf):
            c = t.buf[pos]
            if c not in allowed:
                raise t.damaged(pos, f"not a trace (expected one of {allowed!r}, found {c!r})")
            return pos, c
        if t.eof:
            raise t.damaged(pos, "truncated")
        pos = t.refill(pos)


def open_text(path: str):
    """The file as text: .gz decompressed on the fly (any file starting with gzip's magic bytes is gzip)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    raw = gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")  # noqa: SIM115 (the caller closes)
    return io.TextIOWrapper(raw, encoding="utf-8")


def read_columns(path: str) -> RankColumns:
    """Read one trace file into RankColumns (see the module docstring). Raises TraceDamaged for a truncated or
    invalid file, naming the file and the position."""
    cols = RankColumns(path=path)
    with open_text(path) as f:
        t = _Text(f, path)
        pos, _ = _skip(t, 0, "{")
        pos += 1
        while True:
            pos, c = _skip(t, pos, '"}')
            if c == "}":
                break
            key, pos = _value(t, pos)
            pos, _ = _skip(t, pos, ":")
            if key == "traceEvents":
                pos, _ = _skip(t, pos + 1, "[")
                pos = _events(t, pos + 1, cols)
            else:
                cols.info[key], pos = _value(t, pos + 1)
            pos, c = _skip(t, pos, ",}")
            pos += 1
            if c == "}":
                break
        cols.chars = t.base + pos
    return cols


def _events(t: _Text, pos: int, cols: RankColumns) -> int:
    """Read the traceEvents array from `pos` (just after '[') to just after its ']'; returns that position."""
    names: dict = {}
    add = _adder(cols, names)
    ws = _WS
    n, between = 0, False  # between: an event was just read, so ',' or ']' comes next
    while True:
        buf = t.buf
        pos = ws(buf, pos).end()
        if pos >= len(buf) - 1 and not t.eof:  # near the end of the window: the next event may be cut
            pos = t.refill(pos)
            continue
        if pos >= len(buf):
            raise t.damaged(pos, "truncated")
        c = buf[pos]
        if c == "]" and (between or not n):
            cols.names = list(names)
            cols.n_events = n
            return pos + 1
        if between:
            if c != ",":
                raise t.damaged(pos, f"not valid JSON (expected ',' or ']' after an event, found {c!r})")
            pos, between = pos + 1, False
            continue
        try:
            e, pos = _decode(buf, pos)
        except json.JSONDecodeError as err:
            if t.eof:
                raise t.damaged(
                    err.pos, "truncated" if not buf[err.pos :].strip() else f"not valid JSON ({err.msg})"
                ) from None
            if not _maybe_cut(buf, err):
                raise t.damaged(err.pos, f"not valid JSON ({err.msg})") from None
            pos = t.refill(pos)
            continue
        between = True
        n += 1
        if type(e) is dict:
            add(e)


def _adder(cols: RankColumns, names: dict):
    """The per-event function: one dict lookup for the category, a few appends for what is kept."""
    cats = CATEGORIES

    def name_id(name: str) -> int:
        i = names.get(name)
        if i is None:
            i = names[name] = len(names)
        return i

    def add(e: dict) -> None:
        kind = cats.get(e.get("cat"))
        if kind is None or e.get("ph") != "X":
            return
        args = e.get("args") or {}
        if kind == DEVICE:
            name = e.get("name", "")
            cols.dev_name.append(name_id(name))
            cols.dev_ts.append(e["ts"])
            cols.dev_dur.append(e.get("dur", 0))
            cols.dev_stream.append(_int(args.get("stream", e.get("tid"))))
            cols.dev_corr.append(_int(args.get("correlation")))
            if name.startswith("nccl") or "ncclKernel" in name or "Collective name" in args:
                cols.comm_dev[len(cols.dev_ts) - 1] = {k: args[k] for k in _META_KEYS if k in args}
        elif kind == RUNTIME:
            cols.rt_corr.append(_int(args.get("correlation")))
            cols.rt_tid.append(_int(e.get("tid")))
            cols.rt_ts.append(e["ts"])
        else:
            name = e.get("name", "")
            if name.startswith("ProfilerStep"):
                cols.steps.append((name, e["ts"], e.get("dur", 0), _int(e.get("tid"))))
                return
            tid = _int(e.get("tid"))
            if _COMM_CPU.match(name):
                cols.comm_cpu.append(
                    (name, tid, e["ts"], e.get("dur", 0), {k: args[k] for k in _META_KEYS if k in args})
                )
            cols.cpu_name.append(name_id(name))
            cols.cpu_tid.append(tid)
            cols.cpu_ts.append(e["ts"])
            cols.cpu_dur.append(e.get("dur", 0))

    return add
