"""Alpha and beta from a trace, only where the trace can support them.

One rank's NCCL kernel lasts from the moment that rank arrives until the collective finishes, so it includes the
rank's wait for the slowest peer: a line fitted to one rank's kernel durations fits the arrival skew, not the link.
With every rank's trace, each collective is matched across its group (process group and sequence number when the
trace records them, else the order of collectives within the process group on each rank), the ranks' clocks are
aligned (a ring collective ends on every rank within a hop of the others, so each rank's offset is the median of
its end times less the group's median end), and the transfer is priced from the last rank to arrive:
t = median end - last arrival. With one rank, missing ranks, no match or fewer than 3 sizes of an op, `fit_trace`
refuses with the reason and shows the spread of the durations instead. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from dtlab.units import fmt_bytes_exact

FIT_OPS = ("all_reduce", "all_gather", "reduce_scatter")  # the ops dtlab's cost model has alpha-beta forms for


def bus_factor(op: str, p) -> float:
    """nccl-tests' bus bandwidth factor: 2(p-1)/p for all-reduce, (p-1)/p for all-gather, reduce-scatter and
    all-to-all, 1 for the rest."""
    p = float(p)
    if p <= 1:
        return 1.0
    if op == "all_reduce":
        return 2 * (p - 1) / p
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p
    return 1.0


def _why_not(trace) -> str | None:
    """Why the trace cannot support matching collectives across ranks; None when it can."""
    unknown = [r.path for r in trace.ranks if not r.rank_known]
    if unknown:
        return f"no rank information in {', '.join(unknown)}: collectives cannot be matched across ranks"
    if len(trace.ranks) < 2:
        return (
            "one rank's trace: its collective kernels include its wait for the slowest peer, and when the other "
            "ranks arrived is not in it (give the folder with every rank's trace)"
        )
    world = {r.world_size for r in trace.ranks if r.world_size}
    have = {r.rank for r in trace.ranks}
    if len(world) == 1:
        missing = sorted(set(range(world.pop())) - have)
        if missing:
            return f"ranks {missing} of the job are missing: every rank's trace is needed"
    return None


def match_collectives(trace) -> pd.DataFrame:
    """The collectives that every rank of their group recorded, with `key` (the match) and `aligned_start`,
    `aligned_end` (s, on rank-aligned clocks). Keys: (pg, seq) when every row has a sequence number, else (pg,
    order within the process group on each rank). A group whose rows disagree on op or bytes is left out."""
    c = trace.collectives
    if c.empty:
        return c.assign(key=[], aligned_start=[], aligned_end=[])
    c = c.sort_values(["rank", "t_start"]).reset_index(drop=True)
    if c["seq"].notna().all():
        c["key"] = list(zip(c["pg"], c["seq"].astype("int64")))
    else:
        c["key"] = list(zip(c["pg"], c.groupby(["rank", "pg"]).cumcount()))
    nranks = len(trace.ranks)
    size = c["group_size"].fillna(nranks).astype("int64")
    g = c.groupby("key")
    ok = (
        (g["rank"].transform("nunique") == size)
        & (g["op"].transform("nunique") == 1)
        & (g["nbytes"].transform("nunique", dropna=False) == 1)
    )
    m = c[ok].copy()
    if m.empty:
        return m.assign(aligned_start=[], aligned_end=[])
    ref = m.groupby("key")["t_end"].transform("median")
    offset = (m["t_end"] - ref).groupby(m["rank"]).median()
    m["aligned_start"] = m["t_start"] - m["rank"].map(offset)
    m["aligned_end"] = m["t_end"] - m["rank"].map(offset)
    m.attrs["offsets_s"] = offset.to_dict()
    return m


def arrivals(trace) -> pd.DataFrame:
    """One row per matched collective: step, op, nbytes (B), group_size, first_rank and last_rank to arrive,
    skew_s (last arrival - first arrival, s: how long the first rank waited), transfer_s (median end - last
    arrival, s), longest_s (the longest kernel of the group, s). Empty when the trace cannot be matched."""
    cols = ["key", "step", "op", "nbytes", "group_size", "first_rank", "last_rank", "skew_s", "transfer_s", "longest_s"]
    if _why_not(trace):
        return pd.DataFrame(columns=cols)
    m = match_collectives(trace)
    if m.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for key, g in m.groupby("key", sort=False):
        first, last = g.loc[g["aligned_start"].idxmin()], g.loc[g["aligned_start"].idxmax()]
        rows.append(
            {
                "key": key,
                "step": int(g["step"].min()),
                "op": first["op"],
                "nbytes": first["nbytes"],
                "group_size": len(g),
                "first_rank": int(first["rank"]),
                "last_rank": int(last["rank"]),
                "skew_s": last["aligned_start"] - first["aligned_start"],
                "transfer_s": g["aligned_end"].median() - last["aligned_start"],
                "longest_s": (g["t_end"] - g["t_start"]).max(),
            }
        )
    return pd.DataFrame(rows, columns=cols)


def spread(trace) -> pd.DataFrame:
    """Per op, size and group: count and the median, 10th and 90th percentile of the collectives' durations
    (s), what can be said without a fit."""
    c = trace.collectives
    cols = ["op", "nbytes", "group_size", "count", "median_s", "p10_s", "p90_s"]
    if c.empty:
        return pd.DataFrame(columns=cols)
    c = c.assign(d=c["t_end"] - c["t_start"], nbytes=c["nbytes"].fillna(-1), group_size=c["group_size"].fillna(-1))
    g = c.groupby(["op", "nbytes", "group_size"])["d"]
    out = pd.DataFrame(
        {"count": g.size(), "median_s": g.median(), "p10_s": g.quantile(0.1), "p90_s": g.quantile(0.9)}
    ).reset_index()
    return out[cols]


@dataclass
class TraceFit:
    """What a trace supports: `fits` (op -> dtlab.model.fit.AlphaBetaFit), `refused` (op, or '*' for the whole
    trace -> the reason), `spread` (durations per op and size, s), `matched` (collectives matched across ranks),
    `offsets_s` (each rank's clock offset found by the alignment, s)."""

    fits: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    spread: pd.DataFrame = field(default_factory=pd.DataFrame)
    matched: int = 0
    offsets_s: dict = field(default_factory=dict)

    def text(self) -> str:
        """The fits (alpha in us, beta as GB/s), each refusal with its reason, and the spread when refused."""
        lines = []
        for op, f in self.fits.items():
            lines.append(
                f"{op}: alpha {f.alpha * 1e6:.2f} us, beta {f.beta * 1e9:.4g} s/GB "
                f"({1 / f.beta / 1e9 if f.beta > 0 else float('inf'):.3g} GB/s), {f.n_points} sizes, "
                f"{f.n_samples} matched collectives, relative RMS {100 * f.rel_rms:.1f} %"
            )
        for op, why in self.refused.items():
            lines.append(f"{'no fit' if op == '*' else op + ': no fit'}: {why}")
        if self.refused and not self.spread.empty:
            lines.append("spread of the durations instead (ms):")
            for r in self.spread.itertuples():
                size = fmt_bytes_exact(int(r.nbytes)) if r.nbytes >= 0 else "? B"
                lines.append(
                    f"  {r.op:<14} {size:>16} x{int(r.count):<4} median {r.median_s * 1e3:8.3f} ms, "
                    f"p10 {r.p10_s * 1e3:8.3f} ms, p90 {r.p90_s * 1e3:8.3f} ms"
                )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def fit_trace(trace, form: str = "ring", min_sizes: int = 3) -> TraceFit:
    """Fit alpha and beta per op from the collectives matched across every rank, priced from the last arrival
    (see the module docstring); refuse what the trace cannot support, with the reason and the spread."""
    from dtlab.model.fit import fit_alpha_beta

    out = TraceFit(spread=spread(trace))
    why = _why_not(trace)
    if why:
        out.refused["*"] = why
        return out
    m = match_collectives(trace)
    out.offsets_s = m.attrs.get("offsets_s", {})
    a = arrivals(trace)
    out.matched = len(a)
    if a.empty:
        out.refused["*"] = "no collective was recorded by every rank of its group (nothing to match)"
        return out
    a = a[(a["transfer_s"] > 0) & a["nbytes"].notna()]
    for op, g in a.groupby("op"):
        if op not in FIT_OPS:
            out.refused[op] = f"dtlab's cost model has no alpha-beta form for {op}"
            continue
        sizes = g["nbytes"].nunique()
        if sizes < min_sizes:
            shown = ", ".join(fmt_bytes_exact(int(n)) for n in sorted(g["nbytes"].unique()))
            out.refused[op] = f"only {sizes} message size(s) ({shown}): alpha and beta need at least {min_sizes}"
            continue
        samples = pd.DataFrame(
            {"op": op, "nbytes": g["nbytes"].astype("int64"), "nproc": g["group_size"], "seconds": g["transfer_s"]}
        )
        try:
            out.fits[op] = fit_alpha_beta(samples, op, form=form)
        except ValueError as e:
            out.refused[op] = str(e)
    return out
