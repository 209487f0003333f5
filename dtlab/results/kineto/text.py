"""A trace as text: what `dtlab trace PATH` prints. Times in ms, sizes in bytes, bandwidth in GB/s. Pure."""

from __future__ import annotations

import math

from dtlab.units import fmt_bytes_exact


def _ms(x) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:9.3f}"


def breakdown_text(trace) -> str:
    """Per rank and step: T_step, T_comp, T_comm, exposed (ms) and overlap (%)."""
    b = trace.breakdown()
    if b.empty:
        return "breakdown: the trace has no ProfilerStep spans (record with torch.profiler's schedule and step())"
    title = (
        "breakdown per rank and ProfilerStep (unions of kernel intervals; exposed = communication no compute covers)"
    )
    header = (
        f"{'rank':>5} {'step':>6} {'T_step ms':>10} {'T_comp ms':>10} {'T_comm ms':>10} "
        f"{'exposed ms':>10} {'overlap %':>9} {'collectives':>11}"
    )
    lines = [title, header]
    for r in b.itertuples():
        ov = "-" if r.overlap != r.overlap else f"{100 * r.overlap:9.1f}"
        tag = " (no-op baseline)" if r.baseline else ""
        lines.append(
            f"{r.rank:>5} {r.step:>6} {_ms(r.T_step):>10} {_ms(r.T_comp):>10} {_ms(r.T_comm):>10} "
            f"{_ms(r.exposed):>10} {ov:>9} {r.collectives:>11}{tag}"
        )
    return "\n".join(lines)


def table_text(trace) -> str:
    """The collectives grouped by op and size: count, median (ms), bus bandwidth (GB/s), metadata source."""
    t = trace.table()
    if t.empty:
        return "collectives: none found (no NCCL kernels, no gloo spans)"
    lines = [
        "collectives by op and size (all ranks)",
        f"{'op':<15} {'bytes':>16} {'group':>5} {'count':>6} {'median ms':>10} {'busbw GB/s':>10}  source",
    ]
    for r in t.itertuples():
        size = fmt_bytes_exact(r.nbytes) if r.nbytes >= 0 else "? B"
        bw = "-" if r.busbw_GBps != r.busbw_GBps else f"{r.busbw_GBps:10.2f}"
        group = str(r.group_size) if r.group_size > 0 else "?"
        lines.append(f"{r.op:<15} {size:>16} {group:>5} {r.count:>6} {r.median_ms:10.3f} {bw:>10}  {r.source}")
    return "\n".join(lines)


def overlap_text(trace) -> str:
    """Holistic Trace Analysis's overlap per rank, with and without the last step."""
    a, b = trace.overlap(), trace.overlap(last_step=True)
    lines = ["comm/comp overlap per rank, Holistic Trace Analysis's definition (% of communication time):"]
    for x, y in zip(a.itertuples(), b.itertuples()):
        lines.append(
            f"  rank {x.rank}: {x.overlap_pct:.2f} % (kernels launched before the last ProfilerStep, as "
            f"HTA), {y.overlap_pct:.2f} % with the last step"
        )
    return "\n".join(lines)


def summary_text(trace) -> str:
    """Header, breakdown, collectives table, HTA's overlap, the fit or why not, and the notes."""
    ranks = [r.rank for r in trace.ranks]
    events = sum(r.n_events for r in trace.ranks)
    head = (
        f"trace: {trace.path} ({len(ranks)} file(s), ranks {ranks}, {events:,} events, "
        f"{sum(r.chars for r in trace.ranks) / 1e6:.1f} MB of JSON)"
    )
    parts = [head, breakdown_text(trace), table_text(trace), overlap_text(trace), "alpha-beta:\n" + trace.fit().text()]
    if trace.notes:
        parts.append("notes:\n" + "\n".join(f"  {n}" for n in trace.notes))
    return "\n\n".join(parts)
