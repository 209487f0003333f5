"""A real cluster's nccl-tests output as a dtlab Profile, and the public outputs shipped with dtlab.

`load_nccl_tests(path_or_text)` returns the same Profile `dtlab.calibrate` returns, so everything that takes a
calibration takes it: the fits with their intervals and size regimes, `dtlab.predict`, the explorer. The public
outputs (nccl-tests/sources.json: where each was posted, the system, the licence) load by name with
`public_nccl_tests(name)`; `public_nccl_tests()` lists them.
"""

from __future__ import annotations

import json
import os

import pandas as pd

from dtlab.model.profile import Profile
from dtlab.results.nccl_tests import NcclTestsTable, parse_nccl_tests

PUBLIC_DIR = os.path.join(os.path.dirname(__file__), "nccl-tests")
#: The most size regimes a fit of nccl-tests output may have: NCCL's LL, LL128 and Simple protocols times its ring
#: and tree (or NVLS) algorithms give more switches than a dtlab calibration's 15 sizes show; BIC decides how many.
MAX_SEGMENTS = 5


def nccl_tests_samples(table: NcclTestsTable) -> pd.DataFrame:
    """The table as calibration samples: one row per size and column (out-of-place, in-place) with op, nbytes
    (bytes), nproc, seconds (nccl-tests' mean time per iteration), place, algbw and busbw (GB/s, as printed),
    line (in the output)."""
    rows = []
    for r in table.rows.itertuples():
        for place, pre in (("out-of-place", ""), ("in-place", "ip_")):
            t = getattr(r, f"{pre}time_us", None)
            if t is None or t != t:
                continue
            rows.append(
                {
                    "op": table.op,
                    "nbytes": int(r.size),
                    "nproc": table.nproc,
                    "seconds": float(t) * 1e-6,
                    "place": place,
                    "algbw": float(getattr(r, f"{pre}algbw")),
                    "busbw": float(getattr(r, f"{pre}busbw")),
                    "line": int(r.line),
                }
            )
    return pd.DataFrame(rows)


def load_nccl_tests(
    path_or_text,
    op: str | None = None,
    nproc: int | None = None,
    nodes: int | None = None,
    min_bytes: int | None = None,
    max_bytes: int | None = None,
    max_segments: int = MAX_SEGMENTS,
    system: dict | None = None,
) -> Profile:
    """Read one nccl-tests output (a file path, or the output's text) into a Profile fitted as a calibration is.

    op: 'all_reduce', 'all_gather' or 'reduce_scatter' when the output does not say which collective it timed
    (it is told from the rows where they can; a contradiction is refused). nproc, nodes: rank and node counts for
    output without device lines. min_bytes, max_bytes: the sizes the fits use (bytes; all by default). The fits:
    the ring form's alpha (s) and beta (s/B) over all sizes, and up to max_segments size regimes chosen by BIC
    (dtlab.model.fit.fit_piecewise). meta['source'] records the file, how op, ranks and nodes were told, hosts,
    GPU models, versions, the footer's average busbw; `system` (a dict) is added to it as given.
    Damaged or cut output raises NcclTestsDamaged naming the line; nothing is half-read."""
    table = parse_nccl_tests(path_or_text, op=op, nproc=nproc, nodes=nodes)
    samples = nccl_tests_samples(table)
    hosts = table.hosts
    n_nodes = table.nodes
    source = {
        "format": "nccl-tests",
        "file": table.source,
        "op": table.op,
        "op_from": table.op_from,
        "nproc_from": table.nproc_from,
        "nodes_from": table.nodes_from or "not recorded: no device lines and nodes not given",
        "rows": len(table.rows),
        "sizes_bytes": [int(table.rows["size"].min()), int(table.rows["size"].max())],
        "avg_busbw_GBps": table.avg_busbw,
        "out_of_bounds": table.out_of_bounds,
        "header": table.header,
        "skipped_lines": table.skipped_lines,
        **({"system": dict(system)} if system else {}),
    }
    meta = {
        "source": source,
        "backend": "nccl",
        "world_size": table.nproc,
        "nnodes": n_nodes or 1,
        "ranks_per_node": table.nproc // n_nodes if n_nodes else None,
        "hosts": hosts,
        "host": hosts[0] if len(hosts) == 1 else None,
        "devices": table.gpu_models,
        "versions": dict(table.versions),
        "timing": "nccl-tests: the mean time per iteration over its timed iterations, out-of-place and in-place "
        "(dtlab fits their median per size)",
    }
    caveats = [
        f"nccl-tests output ({table.source}): {table.op} on {table.nproc} ranks"
        + (f", {n_nodes} node(s)" if n_nodes else ", node count not recorded")
        + "; NCCL picks its protocol and algorithm per size, so the fit is piecewise where the data say so"
    ]
    if table.out_of_bounds and not table.out_of_bounds.endswith("OK"):
        caveats.append(f"nccl-tests reported wrong values: 'Out of bounds values : {table.out_of_bounds}'")
    return Profile.from_samples(
        samples,
        meta=meta,
        form="ring",
        caveats=caveats,
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        max_segments=max_segments,
    )


def _sources() -> dict:
    with open(os.path.join(PUBLIC_DIR, "sources.json"), encoding="utf-8") as fh:
        return json.load(fh)["outputs"]


def public_nccl_tests(name: str | None = None, **kwargs):
    """The public nccl-tests outputs shipped with dtlab. Without a name: a DataFrame, one row per output (name,
    op, system, gpu, gpus, nodes, interconnect, source URL, posted, nccl-tests and NCCL versions, licence, path).
    With a name: that output loaded by load_nccl_tests (keyword arguments passed on), its provenance in
    meta['source']['system']."""
    src = _sources()
    if name is None:
        rows = [
            {"name": k, **{c: v for c, v in d.items() if c != "file"}, "path": os.path.join(PUBLIC_DIR, d["file"])}
            for k, d in src.items()
        ]
        return pd.DataFrame(rows)
    if name not in src:
        raise ValueError(f"name must be one of {sorted(src)}, got {name!r}")
    d = src[name]
    kwargs.setdefault("nodes", d["nodes"])
    kwargs.setdefault("system", {"name": name, **d})
    return load_nccl_tests(os.path.join(PUBLIC_DIR, d["file"]), op=kwargs.pop("op", d["op"]), **kwargs)
