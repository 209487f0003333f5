"""The claim lab 0 prints: a 1 MiB all-reduce takes longer than a 4 KiB one (dtlab.course.claims)."""

from __future__ import annotations

from dtlab.course.claims import compare, spread
from dtlab.units import fmt_ratio


def smoke_claim(t_ms: dict):
    """'A 1 MiB all-reduce takes longer than a 4 KiB one' from the smoke test's timed calls (ms)."""
    small, big = min(t_ms), max(t_ms)
    a, b = [v / 1e3 for v in t_ms[big]], [v / 1e3 for v in t_ms[small]]

    def why(outcome):
        ratio = spread(a).median / spread(b).median
        if ratio > 1:
            head = (
                f"the larger calls took longer in the median ({fmt_ratio(ratio)}), but the {len(a)} calls per size "
                "scatter so much that the middle halves of the two sets overlap"
            )
        else:
            head = (
                f"the {small:,} B calls took longer in the median than the {big:,} B ones: with {len(a)} timed "
                "calls per size, a call's time here varies more with what the shared cores are doing (gloo's "
                "threads waking, the other rank getting a core) than with the extra bytes"
            )
        return head + ". Lab 2 separates the two terms with a fit over many sizes and more calls."

    return compare(
        "lab00.sizes",
        f"an all-reduce of {big:,} B takes longer than one of {small:,} B: it moves {big // small}x the bytes",
        "time per call (slowest rank)",
        (f"{big:,} B", a),
        (f"{small:,} B", b),
        expected=None,
        model="alpha + beta n: the latency term is the same, the bandwidth term grows with n",
        test="above",
        why=why,
        per="call",
        paired=False,
    )
