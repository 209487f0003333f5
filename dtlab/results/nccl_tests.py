"""nccl-tests output (`all_reduce_perf`, `all_gather_perf`, `reduce_scatter_perf`) read into rows and facts.

The reader is strict: every line that starts like a table row (an integer) must be a whole row whose numbers
agree with each other (count x type size against size, algbw = size / time, busbw = algbw x the op's factor),
or the output is refused naming the line. Other lines (NCCL's own INFO lines, a shell prompt) are skipped, as
nccl-tests interleaves them. What each version prints, all read here:

- the oldest tables: `size count type redop time algbw busbw error` (all_gather without `redop`);
- from nccl-tests 2.10: `size count type redop root time algbw busbw #wrong`, both out-of-place and in-place;
- `-o avg` (redop `avg`), `-c 0` (`N/A` in the check column);
- rows of 0 bytes before the first sized one (all_gather and reduce_scatter at `-b` below ranks x type size):
  checked like any row, then set aside and counted (`zero_rows`); a 0-byte row after a sized one is refused;
- lines prefixed by the launcher: `[1,0]<stdout>:` (Open MPI's --tag-output), `0: ` (srun --label);
- the device lines (`#  Rank  0 Group  0 Pid 6899 on HOST device  0 [0000:04:00] NVIDIA H100 80GB HBM3`):
  GPU model, host per rank, rank count, nodes (distinct hosts); a listing cut short in the posting (`...`, or the
  last rank alone) gives the rank count from its highest rank, and the node count only when `nodes=` is given;
- a table whose runs of spaces were collapsed to one (a web page's text), and launcher messages between the lines
  (`[host:pid] 15 more processes have sent help message ...`, skipped and counted);
- the header (`nThread 1 nGpus 8 minBytes 8 maxBytes ... step: 2(factor)`), the version line (2.17+), the
  `Collective test starting: all_reduce_perf` line, and the footer (`# Out of bounds values`, `# Avg bus
  bandwidth`).

An output with its header but without its footer was cut: it is refused. Pasted tables without header or footer
are read as posted (a cut at a row boundary cannot be told from a shorter sweep there).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import pandas as pd

#: Bytes per element of the types nccl-tests prints.
TYPE_BYTES = {
    "int8": 1, "uint8": 1, "char": 1, "f8e4m3": 1, "f8e5m2": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "half": 2, "float16": 2, "bfloat16": 2, "bf16": 2,
    "int32": 4, "uint32": 4, "int": 4, "float": 4, "float32": 4,
    "int64": 8, "uint64": 8, "double": 8, "float64": 8,
}  # fmt: skip
#: The ops dtlab models, and nccl-tests' ratio busbw / algbw for each at p ranks (its doc/PERFORMANCE.md).
BUS_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
}
OPS = tuple(BUS_FACTOR)

_PREFIX = re.compile(r"^\s*(?:\[\d+,\d+\]<std(?:out|err)>:|\[\d+,\d+\]:|\d+:(?=\s))")
_DEVICE = re.compile(
    r"^#?\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)\s+\[([^\]]*)\]\s*(.*?)\s*$"
)
_HEADER = re.compile(r"nThread\s+(\d+)\s+nGpus\s+(\d+)\s+minBytes\s+(\d+)\s+maxBytes\s+(\d+)\s+step:\s*(\d+)\((\w+)\)")
_VERSION = re.compile(r"nccl-tests version\s+(\S+).*?nccl-headers=(\d+)\s+nccl-library=(\d+)")
_NCCL = re.compile(r"NCCL version\s+(\d+\.\d+\.\d+)")
_STARTING = re.compile(r"Collective test (?:starting|concluded):\s*(\w+?)_perf")
_BOUNDS = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s+(\w+)")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_PERF_COLUMNS = ("time", "algbw", "busbw", "check")


class NcclTestsDamaged(ValueError):
    """nccl-tests output that cannot be read whole: `line` is the 1-based line number it stopped at (or None)."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


@dataclass(kw_only=True)
class NcclTestsTable:
    """One nccl-tests output, read: `rows` (size, count, type, redop, root, time_us, algbw, busbw, check,
    ip_time_us, ip_algbw, ip_busbw, ip_check, line: times in microseconds, bandwidths in GB/s = 10^9 B/s as
    printed), `op` and how it was told (`op_from`), `nproc` and `nodes` and how they were told, the devices
    (rank, host, device, bus id, model), versions, the header's fields, the footer's figures, the lines skipped
    and the 0-byte rows set aside."""

    source: str
    rows: pd.DataFrame
    op: str
    op_from: str
    nproc: int
    nproc_from: str
    nodes: int | None
    nodes_from: str | None
    devices: list[dict] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    header: dict = field(default_factory=dict)
    avg_busbw: float | None = None
    out_of_bounds: str | None = None
    skipped_lines: int = 0
    zero_rows: int = 0

    @property
    def hosts(self) -> list[str]:
        """The distinct hosts named by the device lines, in rank order."""
        return list(dict.fromkeys(d["host"] for d in self.devices))

    @property
    def gpu_models(self) -> list[str]:
        """The distinct GPU models named by the device lines."""
        return list(dict.fromkeys(d["model"] for d in self.devices if d["model"]))


def read_text(path_or_text) -> tuple[str, str]:
    """(text, source name) of a file path or of the output itself (a string holding a newline)."""
    if isinstance(path_or_text, os.PathLike) or (isinstance(path_or_text, str) and "\n" not in path_or_text):
        path = os.fspath(path_or_text)
        if not os.path.isfile(path):
            raise ValueError(f"path_or_text: {path!r} is not a file (pass the output itself as text with its newlines)")
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(), path
    if not isinstance(path_or_text, str):
        raise ValueError(f"path_or_text must be a path or the output's text, got {type(path_or_text).__name__}")
    return path_or_text, "<text>"


def parse_nccl_tests(path_or_text, op: str | None = None, nproc: int | None = None, nodes: int | None = None):
    """Read one nccl-tests output (a path, or the text) into an NcclTestsTable, checking every row (module doc).

    op: 'all_reduce', 'all_gather' or 'reduce_scatter' when the output does not say (it is told from the rows
    where they can: the redop column, count x type size against size; a contradiction is refused). nproc, nodes:
    the rank and node counts when the output has no device lines (else the rank count is read from
    busbw / algbw). Raises NcclTestsDamaged naming the line for damaged or cut output, ValueError for bad input."""
    if op is not None and op not in OPS:
        raise ValueError(f"op must be one of {OPS} or None (told from the rows), got {op!r}")
    for name, v in (("nproc", nproc), ("nodes", nodes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
    text, source = read_text(path_or_text)
    st = _scan(text, source)
    named = st["named_op"]
    if named is not None and named not in OPS:
        raise NcclTestsDamaged(f"{source}: the output names {named}_perf: dtlab models {', '.join(OPS)}", None)
    devices = st["devices"]
    if devices:
        ranks = sorted({d["rank"] for d in devices})
        seen_p = ranks[-1] + 1
        if nproc is not None and nproc != seen_p:
            raise ValueError(f"nproc={nproc} contradicts the device lines, which list ranks 0..{seen_p - 1}")
        nproc, nproc_from = seen_p, "device lines"
        if len(ranks) != seen_p:
            nproc_from = f"device lines (ranks listed: {len(ranks)} of {seen_p})"
        hosts = {d["host"] for d in devices}
        complete = len(ranks) == seen_p
        if nodes is not None and (nodes < len(hosts) or (complete and nodes != len(hosts))):
            listed = "" if complete else f" in the {len(ranks)} of {seen_p} ranks they list"
            raise ValueError(f"nodes={nodes} contradicts the device lines, which name {len(hosts)} host(s){listed}")
        if complete:
            nodes, nodes_from = len(hosts), "device lines (distinct hosts)"
        elif nodes is not None:
            nodes_from = "given"
        else:  # a listing cut short ('...') names some hosts only: the node count is not told by it
            nodes_from = f"not told: the device lines list {len(ranks)} of {seen_p} ranks; pass nodes="
    else:
        nproc_from = "given" if nproc is not None else None
        nodes_from = "given" if nodes is not None else None
    rows = pd.DataFrame(st["rows"])
    op, op_from, nproc, nproc_from = _tell_op(rows, op, named, nproc, nproc_from, source)
    _check_bus(rows, op, nproc, source)
    return NcclTestsTable(
        source=source,
        rows=rows,
        op=op,
        op_from=op_from,
        nproc=nproc,
        nproc_from=nproc_from,
        nodes=nodes,
        nodes_from=nodes_from,
        devices=devices,
        versions=st["versions"],
        header=st["header"],
        avg_busbw=st["avg_busbw"],
        out_of_bounds=st["bounds"],
        skipped_lines=st["skipped"],
        zero_rows=st["zero_rows"],
    )


def _scan(text: str, source: str) -> dict:
    """One pass over the lines: rows (checked one by one), device lines, header, versions, footer."""
    st = {"rows": [], "devices": [], "versions": {}, "header": {}, "avg_busbw": None, "bounds": None}
    st.update(named_op=None, skipped=0, zero_rows=0)
    layout, table_at, footer_at, last = None, None, None, 0
    for i, raw in enumerate(text.splitlines(), start=1):
        line = _PREFIX.sub("", raw, count=1).rstrip()
        body = line.strip()
        if not body:
            continue
        last = i
        if (m := _DEVICE.match(body)) is not None:
            rank, host, dev, bus, model = m.groups()
            st["devices"].append({"rank": int(rank), "host": host, "device": int(dev), "bus_id": bus, "model": model})
        elif (m := _HEADER.search(body)) is not None:
            if st["header"]:
                raise NcclTestsDamaged(f"{source}: line {i}: a second nccl-tests header: one output per call", i)
            keys = ("nthread", "ngpus", "min_bytes", "max_bytes", "step", "step_kind")
            st["header"] = {k: (int(v) if k != "step_kind" else v) for k, v in zip(keys, m.groups())}
            st["header"]["line"] = i
        elif (m := _VERSION.search(body)) is not None:
            st["versions"].update({"nccl-tests": m.group(1), "nccl_headers": m.group(2), "nccl": m.group(3)})
        elif (m := _NCCL.search(body)) is not None:
            st["versions"].setdefault("nccl", m.group(1))
        elif (m := _STARTING.search(body)) is not None:
            st["named_op"] = m.group(1)
        elif (m := _BOUNDS.match(body)) is not None:
            st["bounds"] = f"{m.group(1)} {m.group(2)}"
        elif (m := _AVG.match(body)) is not None:
            st["avg_busbw"], footer_at = float(m.group(1)), i
        elif body.startswith("#") and {"size", "count", "type"} <= set(body[1:].split()):
            if st["rows"]:
                raise NcclTestsDamaged(
                    f"{source}: line {i}: a second table's column header after {len(st['rows'])} rows: one output "
                    "per call",
                    i,
                )
            layout, table_at = _layout(body[1:].split(), source, i), i
        elif body.split()[0].isdigit():
            if footer_at is not None:
                raise NcclTestsDamaged(f"{source}: line {i}: a row after the footer (line {footer_at}): {body!r}", i)
            _append_row(st, _row(body, layout, source, i), source, i)
        elif not body.startswith("#"):
            st["skipped"] += 1  # not nccl-tests' own (NCCL's INFO lines, a prompt): skipped, and counted
    if not st["rows"]:
        raise NcclTestsDamaged(f"{source}: no nccl-tests table rows found (size count type ... time algbw busbw)", None)
    h = st["header"]
    if h and footer_at is None:
        raise NcclTestsDamaged(
            f"{source}: line {last}: the output ends without its footer ('# Avg bus bandwidth'), though its header "
            f"(line {h['line']}) was printed: it was cut after {len(st['rows'])} rows",
            last,
        )
    if h and h["step_kind"] == "factor" and h["step"] > 1:
        top = st["rows"][-1]
        if top["size"] * h["step"] <= h["max_bytes"]:
            raise NcclTestsDamaged(
                f"{source}: line {top['line']}: the last row is {top['size']:,} B but the header (line {h['line']}) "
                f"asked for sizes up to {h['max_bytes']:,} B: rows are missing",
                top["line"],
            )
    st["table_line"] = table_at
    return st


def _append_row(st: dict, row: dict, source: str, i: int) -> None:
    """Add a checked row to the scan: one type and reduction per table, sizes increasing; rows of 0 bytes before
    the first sized one (-b below ranks x type size, where nccl-tests times 0 bytes) are set aside and counted."""
    if row["size"] == 0 and row["count"] == 0 and not st["rows"]:
        st["zero_rows"] += 1
        return
    prev = st["rows"][-1] if st["rows"] else None
    if prev and (row["type"], row["redop"]) != (prev["type"], prev["redop"]):
        raise NcclTestsDamaged(
            f"{source}: line {i}: type {row['type']} / redop {row['redop']} after {prev['type']} / "
            f"{prev['redop']} (line {prev['line']}): one type and one reduction per table (nccl-tests "
            "-d all or -o all prints several): pass them one at a time",
            i,
        )
    if prev and row["size"] <= prev["size"]:
        raise NcclTestsDamaged(
            f"{source}: line {i}: size {row['size']:,} B does not follow {prev['size']:,} B (line {prev['line']}): "
            "sizes must increase",
            i,
        )
    st["rows"].append(row)


def _layout(names: list[str], source: str, i: int) -> list[str]:
    """Column names of a table from its header line: size count type [redop] [root] then time algbw busbw and a
    check column (#wrong or error), out-of-place and in-place."""
    cols = [("check" if n in ("#wrong", "error", "wrong") else n) for n in names]
    lead = [c for c in cols if c in ("size", "count", "type", "redop", "root")]
    perf = cols[len(lead) :]
    if lead[:3] != ["size", "count", "type"] or perf not in (list(_PERF_COLUMNS) * 2, list(_PERF_COLUMNS)):
        raise NcclTestsDamaged(f"{source}: line {i}: a column header dtlab does not know: {' '.join(names)!r}", i)
    return lead + [c if k < 4 else f"ip_{c}" for k, c in enumerate(perf)]


def _layout_from_tokens(tokens: list[str]) -> list[str]:
    """The layout of a row without a column header: size count type, a redop when the fourth field is a word, a
    root when a field is left over, then time algbw busbw check once or twice (out-of-place, in-place)."""
    lead = ["size", "count", "type"]
    if len(tokens) > 3 and not _is_number(tokens[3]):
        lead.append("redop")
        if len(tokens) - len(lead) in (9, 5):
            lead.append("root")
    both = len(tokens) - len(lead) == 8
    return lead + [*_PERF_COLUMNS] + ([f"ip_{c}" for c in _PERF_COLUMNS] if both else [])


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def _row(body: str, layout, source: str, i: int) -> dict:
    """One table row, checked: whole, numbers where numbers belong, a known type, algbw = size / time."""
    tokens = body.split()
    cols = layout or _layout_from_tokens(tokens)
    if len(tokens) != len(cols):
        raise NcclTestsDamaged(
            f"{source}: line {i}: {len(tokens)} fields where the table has {len(cols)} ({' '.join(cols)}): "
            f"damaged or cut: {body!r}",
            i,
        )
    row = dict(zip(cols, tokens))
    try:
        out = {"size": int(row["size"]), "count": int(row["count"]), "type": row["type"]}
        out["redop"] = row.get("redop")
        out["root"] = int(row["root"]) if "root" in row else None
        for c in ("time", "algbw", "busbw", "ip_time", "ip_algbw", "ip_busbw"):
            if c in row:
                out[c.replace("time", "time_us")] = float(row[c])
    except ValueError as err:
        raise NcclTestsDamaged(f"{source}: line {i}: not a number where one belongs ({err}): {body!r}", i) from None
    out["check"], out["ip_check"] = row.get("check"), row.get("ip_check")
    if out["type"] not in TYPE_BYTES:
        raise NcclTestsDamaged(f"{source}: line {i}: unknown type {out['type']!r} (known: {sorted(TYPE_BYTES)})", i)
    for place in ("", "ip_"):
        t, bw = out.get(f"{place}time_us"), out.get(f"{place}algbw")
        if t is None:
            continue
        if not t > 0:
            raise NcclTestsDamaged(f"{source}: line {i}: time {t} us is not positive: {body!r}", i)
        # algbw is printed with 2 decimals from the same time: they agree to rounding, or a field is damaged
        expect = out["size"] / t / 1e3
        if abs(bw - expect) > 0.006 + 0.01 * expect:
            raise NcclTestsDamaged(
                f"{source}: line {i}: {'in-place ' if place else ''}algbw {bw} GB/s is not size / time = "
                f"{expect:.2f} GB/s: damaged row {body!r}",
                i,
            )
    out["line"] = i
    return out


def _tell_op(rows: pd.DataFrame, op, named, nproc, nproc_from, source: str):
    """(op, how it was told, nproc, how it was told) from the rows: count x type size = size for all-reduce,
    = size / p for all-gather and reduce-scatter (counts per rank); redop 'none' for all-gather."""
    k = rows["size"] / (rows["count"] * rows["type"].map(TYPE_BYTES))
    per = k.round().astype(int)
    ratio = sorted(set(per))
    if len(ratio) != 1 or (k - per).abs().max() > 1e-9:
        bad = rows.iloc[int((per != per.iloc[0]).idxmax())]
        raise NcclTestsDamaged(
            f"{source}: line {bad['line']}: size / (count x type size) changes between rows: damaged or mixed output",
            int(bad["line"]),
        )
    r = ratio[0]
    redops = set(rows["redop"].dropna())
    roots = set(rows["root"].dropna())
    if roots - {-1}:
        raise ValueError(f"{source}: a rooted collective (root {sorted(roots - {-1})}): dtlab models {', '.join(OPS)}")
    if redops == {"none"} and r == 1:
        raise ValueError(
            f"{source}: redop 'none' with count x type size = size (broadcast or alltoall): "
            f"dtlab models {', '.join(OPS)}"
        )
    if redops == {"none"} or (not redops and r > 1):
        candidates, why = ["all_gather"], "redop 'none'" if redops else "no redop column"
    elif r == 1:
        candidates, why = ["all_reduce"], f"redop {sorted(redops)}, count x type size = size"
    else:
        candidates, why = ["reduce_scatter"], f"redop {sorted(redops)}, count x type size = size / {r}"
    if r > 1:
        if nproc is not None and nproc != r:
            raise ValueError(f"{source}: count x type size = size / {r} says {r} ranks, but nproc is {nproc}")
        if nproc is None:
            nproc, nproc_from = r, f"size / (count x type size) = {r}"
    told = candidates[0]
    if not redops and r == 1:
        told = None  # the oldest all_gather and all_reduce tables both lack redop at r = 1: cannot tell
    for claim, by in ((named, "the output's 'Collective test' line"), (op, "op=")):
        if claim is not None and told is not None and claim != told:
            raise ValueError(f"{source}: {by} says {claim!r}, but the rows say {told!r} ({why})")
    final = named or op or told
    if final is None:
        raise ValueError(f"{source}: the rows do not say which collective this is ({why}): pass op=")
    how = "named by the output" if named else "op=" if op else f"told from the rows ({why})"
    if nproc is None:
        nproc, nproc_from = _nproc_from_bus(rows, final, source)
    return final, how, int(nproc), nproc_from


def _nproc_from_bus(rows: pd.DataFrame, op: str, source: str):
    """The rank count from busbw / algbw = the op's factor, read at the row with the largest algbw."""
    best = rows.loc[rows["algbw"].idxmax()]
    if best["algbw"] < 1.0:
        raise ValueError(f"{source}: no device lines and algbw below 1 GB/s everywhere: pass nproc=")
    f = best["busbw"] / best["algbw"]
    p = round(2 / (2 - f)) if op == "all_reduce" and f < 2 else round(1 / (1 - f)) if f < 1 else None
    if p is None or p < 1:
        raise ValueError(f"{source}: busbw / algbw = {f:.3f} at line {best['line']} fits no rank count: pass nproc=")
    return p, f"busbw / algbw = {f:.4f} at line {int(best['line'])} (no device lines)"


def _check_bus(rows: pd.DataFrame, op: str, p: int, source: str) -> None:
    """Every row's busbw = size / time x the op's factor at p ranks (to the printed rounding), or the op or p is
    wrong."""
    f = BUS_FACTOR[op](p)
    for place in ("", "ip_"):
        if f"{place}busbw" not in rows.columns:
            continue
        # from size / time, not the printed algbw: nccl-tests rounds both from the same unrounded figure
        want = rows["size"] / rows[f"{place}time_us"] / 1e3 * f
        off = (rows[f"{place}busbw"] - want).abs() > 0.006 + 0.01 * want
        if off.any():
            bad = rows[off].iloc[0]
            raise ValueError(
                f"{source}: line {int(bad['line'])}: busbw {bad[place + 'busbw']} GB/s is not algbw x {f:.4f} "
                f"({op} on {p} ranks): the op or the rank count is not what this output measured"
            )
