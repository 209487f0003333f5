"""How far dtlab's own communication timings agree with independent timers of the same steps (NCCL's
per-collective timing, DDP's reducer timer). Pure: reads a loaded `Run`."""

from __future__ import annotations

import numpy as np
import pandas as pd


def crosscheck(run) -> pd.DataFrame:
    """How far dtlab's own communication timings agree with independent timers of the same steps.

    One row per check (measured steps only): quantity, dtlab (median, s), reference (median, s), median
    relative difference (dtlab / reference - 1, over matched pairs), pairs, and what each side measures.

    - NCCL's own per-collective duration (`backend_ms`, from `TORCH_NCCL_ENABLE_TIMING`: CUDA events around
      the kernel on NCCL's stream) against dtlab's service time of the same bucket: t_end minus the later
      of its issue and the previous bucket's end on that rank (one NCCL stream runs buckets one at a time).
      gloo has no such timer, and one NCCL rank launches no kernel (nothing to reduce): the row says so.
    - DDP's own `backward_comm_time` (its reducer's timer: first bucket's communication start to the end of
      the last, per rank and step) against dtlab's span of the same rank-step: last t_end - first t_start.
    """
    rows = []
    b = run.buckets[run.buckets["step"] >= run.warmup] if not run.buckets.empty else run.buckets
    if not b.empty:
        svc = []
        for _, g in b.sort_values("t_start").groupby(["rank", "step"]):
            prev_end = -np.inf
            for r in g.itertuples():
                svc.append((r.t_end - max(r.t_start, prev_end), getattr(r, "backend_ms", None)))
                prev_end = max(prev_end, r.t_end)
        pairs = [(d, ms / 1e3) for d, ms in svc if ms is not None and ms == ms and ms > 0]
        what = (
            "dtlab: t_end - max(t_start, previous bucket's t_end); reference: NCCL's own kernel timing "
            "(TORCH_NCCL_ENABLE_TIMING)"
        )
        if pairs and int(run.resolved.get("world_size") or 2) < 2:
            # One rank: NCCL's in-place sum has nothing to reduce and launches no kernel, so its own duration is
            # about 0 and says nothing about dtlab's interval. Compared with 2 or more NCCL ranks only.
            rows.append(
                (
                    "bucket all-reduce duration vs NCCL",
                    float(np.median([x for x, _ in svc])),
                    np.nan,
                    np.nan,
                    0,
                    what + " -- not compared on one rank: NCCL launches no kernel for a 1-rank sum",
                )
            )
        elif pairs:
            d, ref = np.array(pairs).T
            rows.append(
                (
                    "bucket all-reduce duration vs NCCL",
                    float(np.median(d)),
                    float(np.median(ref)),
                    float(np.median(d / ref - 1)),
                    len(pairs),
                    what,
                )
            )
        else:
            rows.append(
                (
                    "bucket all-reduce duration vs NCCL",
                    float(np.median([x for x, _ in svc])),
                    np.nan,
                    np.nan,
                    0,
                    what + f" -- not available on {run.resolved.get('backend', '?')}",
                )
            )
    rows += _ddp_timer_rows(b, run.ddp_stats)
    return pd.DataFrame(rows, columns=["quantity", "dtlab_s", "reference_s", "median_rel_diff", "pairs", "what"])


def _ddp_timer_rows(b: pd.DataFrame, st: pd.DataFrame) -> list[tuple]:
    """The row comparing the buckets' communication span per rank-step with DDP's own backward_comm_time."""
    if b.empty or st.empty or "backward_comm_time" not in st:
        return []
    span = (
        b.groupby(["rank", "step"])
        .apply(lambda g: g["t_end"].max() - g["t_start"].min(), include_groups=False)
        .rename("dtlab")
    )
    ref = st.set_index(["rank", "step"])["backward_comm_time"].rename("ddp")
    m = pd.concat([span, ref], axis=1, join="inner").dropna()
    m = m[m["ddp"] > 0]
    if m.empty:
        return []
    return [
        (
            "backward communication span vs DDP's timer",
            float(m["dtlab"].median()),
            float(m["ddp"].median()),
            float((m["dtlab"] / m["ddp"] - 1).median()),
            len(m),
            "dtlab: last t_end - first t_start per rank-step; reference: DDP reducer's "
            "backward_comm_time (first bucket's comm start to the end of the last)",
        )
    ]
