"""Local SST-2-format data files: read and checked in the caller's process before anything starts, and read again
by the ranks (dtlab.rank.data), so what was checked is what is trained on."""

from __future__ import annotations

import csv
import io
import json
import os

DATA_EXTENSIONS = (".csv", ".tsv", ".json", ".jsonl", ".parquet")


_CHECKED: dict = {}  # (path, mtime_ns, size) -> rows: validate() may run many times on the same file


def read_data_file(path: str) -> tuple[list[str], list[int]]:
    """Read and check a local SST-2-format file; return (sentences, labels).

    The one reader of local data: `RunConfig.validate()` calls it in the notebook before anything starts,
    and the ranks call it again, so what was checked is what is trained on. Columns `sentence` (non-empty
    text) and `label` (0 or 1; numbers, or digits in a .csv/.tsv) are required; other columns are ignored.
    Raises ValueError naming the problem and the first bad row (rows counted from 1, header excluded)."""
    import pandas as pd

    ext = os.path.splitext(path)[1].lower()
    if ext not in DATA_EXTENSIONS:
        raise ValueError(f"data: file must end in {', '.join(DATA_EXTENSIONS)}, got {path!r}")
    try:
        if ext in (".csv", ".tsv"):
            # Everything as text: a sentence "null" or "NA" stays a sentence; GLUE's TSV has no quoting.
            kw = dict(sep="\t", quoting=csv.QUOTE_NONE) if ext == ".tsv" else {}
            df = pd.read_csv(path, dtype=str, keep_default_na=False, **kw)
        elif ext == ".parquet":
            df = pd.read_parquet(path)
        else:
            df = _read_json_records(path)
    except ValueError as e:
        raise ValueError(f"data: cannot read {path!r} as {ext[1:]}: {' '.join(str(e).split())}") from None
    except Exception as e:  # noqa: BLE001 - a parser's own error type (ParserError, ArrowInvalid, ...)
        raise ValueError(
            f"data: cannot read {path!r} as {ext[1:]}: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from None
    missing = [c for c in ("sentence", "label") if c not in df.columns]
    if missing:
        raise ValueError(
            f"data: {path!r} lacks column(s) {', '.join(missing)} (SST-2 format: sentence, label; "
            f"found: {', '.join(map(str, df.columns)) or 'none'})"
        )
    if len(df) == 0:
        raise ValueError(f"data: {path!r} has no rows")
    sentences, labels = [], []
    for i, (s, y) in enumerate(zip(df["sentence"].tolist(), df["label"].tolist()), start=1):
        if not isinstance(s, str) or not s.strip():
            raise ValueError(f"data: {path!r} row {i}: sentence must be non-empty text, got {s!r}")
        label = _label(y)
        if label is None:
            raise ValueError(
                f"data: {path!r} row {i}: label must be the number 0 or 1 (SST-2: 0 negative, 1 positive), got {y!r}"
            )
        sentences.append(s)
        labels.append(label)
    return sentences, labels


def check_data_file(path: str, min_rows: int) -> int:
    """Read and check `path` (see `read_data_file`); refuse fewer than `min_rows` rows. Returns the row count.

    A run takes steps x batch_size x nproc samples (a baseline step computes its paired step's batch again) and
    cycles through the file in a shuffled order when it has fewer rows (epochs, as any training loop would);
    `min_rows` is one global batch (batch_size x nproc), so no batch ever holds the same row twice."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    if key not in _CHECKED:
        _CHECKED[key] = len(read_data_file(path)[0])
    rows = _CHECKED[key]
    if rows < min_rows:
        raise ValueError(
            f"data: {path!r} has {rows} row(s); a run needs at least batch_size x nproc = {min_rows} "
            f"(one global batch of distinct rows; beyond that the file is cycled)"
        )
    return rows


def _read_json_records(path: str):
    """A .json/.jsonl file: JSON lines, or one JSON array of records, or one object of columns."""

    import pandas as pd

    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return pd.read_json(io.StringIO(text), lines=True, dtype=False)
    if isinstance(doc, dict) and not any(isinstance(v, list) for v in doc.values()):
        doc = [doc]  # a one-line JSON-lines file
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        doc = doc["data"]
    return pd.DataFrame(doc)


def _label(y):
    """0 or 1 from an int, an integral float or (from a text file) digits; None for anything else."""
    if isinstance(y, bool):
        return None
    if isinstance(y, str):
        try:
            y = float(y.strip())
        except ValueError:
            return None
    try:
        v = float(y)
    except (TypeError, ValueError):
        return None
    return int(v) if v in (0.0, 1.0) else None
