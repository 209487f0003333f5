"""A real cluster's nccl-tests output as a dtlab Profile, and the public outputs shipped with dtlab.

`load_nccl_tests(path_or_text)` returns the same Profile `dtlab.calibrate` returns, so everything that takes a
calibration takes it: the fits with their intervals and size regimes, `dtlab.predict`, the explorer. The public
outputs (nccl-tests/sources.json: where each was posted, the system, the licence) load by name with
`public_nccl_tests(name)`; `public_nccl_tests()` lists them.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd

from dtlab.model.profile import Profile
from dtlab.results.nccl_tests import BUS_FACTOR, NcclTestsTable, parse_nccl_tests
from dtlab.units import fmt_bytes, fmt_gbps, fmt_us

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
        "zero_byte_rows": table.zero_rows,
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
    """The public nccl-tests outputs shipped with dtlab: 2 to 128 GPUs on 1 to 32 nodes, all-reduces and one
    all-gather, each with where it was posted (sources.json). Without a name: a DataFrame, one row per output (name,
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
    return load_nccl_tests(os.path.join(PUBLIC_DIR, d["file"]), **kwargs)


def busbw_table(profile: Profile, op: str | None = None) -> pd.DataFrame:
    """Per size of a profile read from nccl-tests: nbytes (bytes), measured seconds (the median of out-of-place and
    in-place), busbw measured and busbw of the piecewise fit and of the single line (GB/s, nccl-tests' bus
    bandwidth: algbw x its factor for op at p ranks), the fits' relative time errors (predicted - measured) /
    measured, and the regime (1-based) each size falls in."""
    op = op or next(iter(profile.fits))
    s = profile.samples[profile.samples["op"] == op]
    p = int(s["nproc"].iloc[0])
    pts = s.groupby("nbytes")["seconds"].median()
    n = pts.index.to_numpy(dtype=float)
    t = pts.to_numpy(dtype=float)
    factor = BUS_FACTOR[op](p)
    piece = np.asarray(profile.predict(op, n, p), dtype=float)
    line = np.asarray(profile.predict(op, n, p, piecewise=False), dtype=float)
    segs = profile.segments.get(op) or []
    bounds = [np.sqrt(a.max_bytes * b.min_bytes) for a, b in zip(segs, segs[1:])]
    return pd.DataFrame(
        {
            "nbytes": n.astype(int),
            "seconds": t,
            "busbw": n / t * factor / 1e9,
            "busbw_fit": n / piece * factor / 1e9,
            "busbw_line": n / line * factor / 1e9,
            "error_fit": piece / t - 1,
            "error_line": line / t - 1,
            "regime": np.searchsorted(bounds, n, side="right") + 1,
        }
    )


def nccl_tests_report(profile: Profile) -> str:
    """The text `dtlab nccl-tests FILE` prints: where the output came from, the single-line fit and each size
    regime with 95 % intervals, then every size's measured busbw beside the fit's (GB/s) and the fit's error."""
    m, src = profile.meta, profile.meta.get("source", {})
    op = src.get("op") or next(iter(profile.fits))
    hosts = m.get("hosts") or []
    where = (
        f"{m.get('world_size')} ranks on {m.get('nnodes')} node(s)"
        + (f" ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})" if hosts else "")
        + (f" | {', '.join(m['devices'])}" if m.get("devices") else "")
    )
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if k != "nccl_headers")
    lines = [
        f"nccl-tests: {op} | {where}" + (f" | {versions}" if versions else ""),
        f"  from {src.get('file')}: op: {src.get('op_from')}; ranks: {src.get('nproc_from')}; "
        f"nodes: {src.get('nodes_from')}",
    ]
    if "system" in src:
        lines.append(f"  system: {src['system'].get('system')} | posted {src['system'].get('posted')}")
        lines.append(f"  source: {src['system'].get('source')}")
    form = "2(p-1) alpha + 2(p-1)/p n beta" if op == "all_reduce" else "(p-1) alpha + (p-1)/p n beta"
    lines.append(f"fit, ring form t = {form} ({op}), 95% intervals:")

    def fit_line(label, f):
        bw = fmt_gbps(1 / f.beta) if f.beta > 0 else "inf"
        return (
            f"  {label:<12} {fmt_bytes(f.min_bytes):>9} .. {fmt_bytes(f.max_bytes):<9} alpha {fmt_us(f.alpha, 2):>9} "
            f"[{fmt_us(f.alpha_ci[0], 2)}, {fmt_us(f.alpha_ci[1], 2)}]  1/beta {bw} "
            f"[{fmt_gbps(1 / f.beta_ci[1]) if f.beta_ci[1] > 0 else 'inf'}, "
            f"{fmt_gbps(1 / f.beta_ci[0]) if f.beta_ci[0] > 0 else 'inf'}]  rel. RMS {f.rel_rms:.1%}"
        )

    lines.append(fit_line("single line", profile.fits[op]))
    for k, seg in enumerate(profile.segments.get(op) or [], start=1):
        lines.append(fit_line(f"regime {k}", seg))
    tab = busbw_table(profile, op)
    lines.append(
        f"{'size':>10} {'time (us)':>11} {'busbw (GB/s)':>13} {'fit (GB/s)':>11} {'fit err':>8} {'line err':>9} regime"
    )
    for r in tab.itertuples():
        lines.append(
            f"{fmt_bytes(r.nbytes):>10} {r.seconds * 1e6:>11.1f} {r.busbw:>13.2f} {r.busbw_fit:>11.2f} "
            f"{r.error_fit:>+8.1%} {r.error_line:>+9.1%} {r.regime:>6}"
        )
    big = tab[tab["nbytes"] >= 2**20]
    if not big.empty:
        lines.append(
            f"sizes >= 1 MiB: median |error| {big['error_fit'].abs().median():.1%} piecewise, "
            f"{big['error_line'].abs().median():.1%} single line (in-sample: the fit saw these sizes)"
        )
    lines += [f"note: {c}" for c in profile.caveats]
    return "\n".join(lines)
