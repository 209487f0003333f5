"""A columnar copy of a finished run's events: what `load_run` reads instead of the JSON lines when it can. Pure.

The JSON lines (events/rank{r}.jsonl) stay the record of truth, written a line at a time by the ranks, so a
killed run keeps everything it wrote. Parsing them is the floor of reading them (microseconds a line), so once a
run has ended `load_run` keeps the frames it built from them in RUN/columns/: one Arrow IPC file per frame (read
at the speed of the disk) and index.json, which says what the copy was made from and is written last:

- `sources`: each rank file's name, bytes, lines and CRC-32, as the strict reader read them. A copy is used only
  when every rank file is still exactly that (same names, sizes and checksums: a file appended to, truncated or
  changed makes the copy stale) and every Arrow file has the size and CRC-32 the index gives it (a damaged copy);
  anything else is ignored and the copy rebuilt from the lines, never trusted.
- `columns_version` (dtlab.results.upgrade.COLUMNS_VERSION), `config_version` and `built_by` (a digest of the
  source of the modules that build the frames): frames built by another form of the reader are rebuilt too, as
  every record made by an earlier dtlab is brought to the current form.
- an empty frame's columns and their types (no file for it); and what is not a frame: the errors, DDP's logging
  data, the machine events, the warnings about damaged lines, and how each rank's events end (for the run's
  state, which is read again from status.json at every load).

A frame the copy cannot hold exactly (a column Arrow cannot type, or one that does not come back the same) means
no copy: that run is read from its lines each time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib

import numpy as np
import pandas as pd
import pyarrow as pa

from dtlab.config.run import CONFIG_VERSION
from dtlab.results.upgrade import COLUMNS_VERSION

FOLDER = "columns"
INDEX = "index.json"
CHUNK = 1 << 24  # bytes read at a time while checking a file's CRC-32
#: the modules whose code decides the frames a copy holds: a change to any of them makes every copy stale
BUILDERS = ("events", "run", "restarts", "convergence", "upgrade", "status", "columns")


def built_by() -> str:
    """A digest of the source of the modules that build a run's frames (BUILDERS), read again only when one of
    those files has changed (its size or modification time)."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.join(here, f"{name}.py") for name in BUILDERS]
    key = tuple((st.st_size, st.st_mtime_ns) for st in map(os.stat, paths))
    if _DIGEST.get("key") != key:
        h = hashlib.sha256()
        for path in paths:
            with open(path, "rb") as f:
                h.update(f.read())
        _DIGEST.update(key=key, digest=h.hexdigest()[:16])
    return _DIGEST["digest"]


_DIGEST: dict = {}  # built_by's last digest and the files' sizes and times it was made from
_EMPTY_OK: set = set()  # the empty frames' forms (columns, types, index) already seen to come back from their meta


def file_check(path: str) -> tuple[int, int]:
    """(bytes, CRC-32) of the file at `path`, read in chunks."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc, n = zlib.crc32(chunk, crc), n + len(chunk)
    return n, crc


def write_copy(run_dir: str, frames: dict, extras: dict, sources: list[dict]) -> bool:
    """Write the columnar copy of a run: `frames` {name: DataFrame}, `extras` (JSON-able), `sources` (one dict per
    rank file: file, bytes, lines, crc32, as read). Returns False, leaving no copy, when a frame cannot be held
    exactly or the folder cannot be written (a read-only or full disk: the lines are read each time then)."""
    final = os.path.join(run_dir, FOLDER)
    tmp = f"{final}.tmp{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        index = {
            "columns_version": COLUMNS_VERSION,
            "config_version": CONFIG_VERSION,
            "built_by": built_by(),
            "sources": sources,
            "frames": {name: _write_frame(df, os.path.join(tmp, f"{name}.arrow")) for name, df in frames.items()},
            "extras": extras,
        }
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump(index, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return True
    except (OSError, ValueError, TypeError, pa.ArrowException):
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def _write_frame(df: pd.DataFrame, path: str) -> dict:
    if df.empty and not df.attrs:  # columns and their types only: no file (most frames of a DDP run are empty)
        meta = {"rows": 0, "columns": [str(c) for c in df.columns], "dtypes": [str(t) for t in df.dtypes]}
        form = (tuple(map(repr, df.columns)), tuple(map(repr, df.dtypes)), repr(df.index), repr(df.columns.dtype))
        if form in _EMPTY_OK or same_frame(df, _empty_frame(meta)):
            _EMPTY_OK.add(form)
            return meta
    table = pa.Table.from_pandas(df, preserve_index=None)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    data = sink.getvalue().to_pybytes()
    back = _read_frame(data)
    if not same_frame(df, back):
        raise ValueError(f"{os.path.basename(path)}: the frame does not come back the same from Arrow")
    with open(path, "wb") as f:
        f.write(data)
    return {"file": os.path.basename(path), "bytes": len(data), "crc32": zlib.crc32(data), "rows": len(df)}


def _empty_frame(meta: dict) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(meta["columns"], meta["dtypes"])})


def _read_frame(data) -> pd.DataFrame:
    return pa.ipc.open_file(pa.py_buffer(data)).read_all().to_pandas()


def same_frame(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """True when `b` is `a`: columns, index, dtypes, attrs and every value (None and NaN told apart)."""
    if not (a.columns.equals(b.columns) and a.index.equals(b.index) and a.attrs == b.attrs):
        return False
    if type(a.index) is not type(b.index) or a.index.dtype != b.index.dtype or a.columns.dtype != b.columns.dtype:
        return False
    if not a.dtypes.equals(b.dtypes):
        return False
    for c in range(a.shape[1]):
        x, y = a.iloc[:, c].to_numpy(), b.iloc[:, c].to_numpy()
        if x.dtype.kind in "fc":
            if not np.array_equal(x, y, equal_nan=True):
                return False
        elif x.dtype == object:
            differ = np.flatnonzero(~np.asarray(x == y, dtype=bool))
            if any(not (_is_nan(x[i]) and _is_nan(y[i])) for i in differ):
                return False
        elif not np.array_equal(x, y):
            return False
    return True


def _is_nan(v) -> bool:
    return isinstance(v, float) and v != v


def read_copy(run_dir: str) -> dict | None:
    """The copy's frames and extras ({"frames": {name: DataFrame}, "extras": ...}), or None when there is none or
    it cannot be trusted (stale, damaged, made by another form of the reader: see the module docstring)."""
    folder = os.path.join(run_dir, FOLDER)
    try:
        with open(os.path.join(folder, INDEX)) as f:
            index = json.load(f)
        if (index.get("columns_version"), index.get("config_version"), index.get("built_by")) != (
            COLUMNS_VERSION,
            CONFIG_VERSION,
            built_by(),
        ):
            return None
        if not _sources_match(run_dir, index["sources"]):
            return None
        frames = {}
        for name, meta in index["frames"].items():
            if "file" not in meta:
                frames[name] = _empty_frame(meta)
                continue
            with open(os.path.join(folder, meta["file"]), "rb") as f:
                data = f.read()
            if len(data) != meta["bytes"] or zlib.crc32(data) != meta["crc32"]:
                return None
            frames[name] = _read_frame(data)
            if len(frames[name]) != meta["rows"]:
                return None
        return {"frames": frames, "extras": index["extras"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, pa.ArrowException):
        return None


def _sources_match(run_dir: str, sources: list[dict]) -> bool:
    """Every rank file is the one the copy was made from: the same names, then sizes, then CRC-32s."""
    ev_dir = os.path.join(run_dir, "events")
    names = sorted(n for n in os.listdir(ev_dir) if n.startswith("rank") and n.endswith(".jsonl"))
    if names != sorted(s["file"] for s in sources):
        return False
    if any(os.path.getsize(os.path.join(ev_dir, s["file"])) != s["bytes"] for s in sources):
        return False
    return all(file_check(os.path.join(ev_dir, s["file"])) == (s["bytes"], s["crc32"]) for s in sources)
