"""A self-contained HTML report of a run's figures (plotly), written next to the run."""

from __future__ import annotations

import html
import os

from dtlab.results.stragglers import run_waits
from dtlab.viz.figures import breakdown_bar, bucket_timeline, bytes_by_op, memory_bars
from dtlab.viz.stragglers import who_waited


def write_report(run, path: str | None = None) -> str:
    """Write the breakdown bar (with each figure's 90% interval), the bucket timeline and the summary table to one
    HTML file; return its path.

    plotly.js is inlined once so the file opens offline."""
    path = path or os.path.join(run.path, "report.html")
    summary = run.summary()  # once: the figures, the table and the text all show the same intervals
    figs = [
        breakdown_bar(summary, title=f"{run.config.strategy} x{run.nproc}"),
        bucket_timeline(run),
        bytes_by_op(run),
        memory_bars({run.config.strategy: run}),
    ]
    if run.config.stragglers.slow and not run.buckets.empty:  # who waited for whom
        figs.insert(2, who_waited(run_waits(run), f"straggler {run.config.stragglers.slow}"))
    parts = [f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs)]
    table = summary.to_html(index=False, float_format=lambda v: f"{v:.4g}")
    body = (
        f"<h1>dtlab run</h1><pre>{html.escape(run.breakdown_table(summary))}</pre>"
        "<p>Each figure: the median and its 90% bootstrap interval (lo, hi); see dtlab's measurement page, "
        "'Spread and noise'.</p>" + table + "".join(parts)
    )
    with open(path, "w") as f:
        f.write(
            f"<!doctype html><html><head><meta charset='utf-8'><title>dtlab report</title></head>"
            f"<body style='font-family:sans-serif'>{body}</body></html>"
        )
    return path
