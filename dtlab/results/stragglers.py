"""Who waited for whom: each rank's wait time per step, measured from the recorded buckets without comparing
clocks, and the synchronous-step model to put beside it. Pure (pandas only).

Clock-free measurement. The ranks' clocks are not comparable (each bucket time is seconds from the rank's own
step start, and on several nodes perf_counter has no common origin), but one fact is: a collective ends on all
ranks at about the same moment, when the last rank has joined it. So for step s and bucket b the rank that
issued b last has the shortest duration t_end - t_start, and every other rank's duration is longer by how long
its collective sat waiting for that rank:

    wait(rank, s, b) = (t_end - t_start)[rank] - min over ranks of (t_end - t_start)

A rank's wait in the step is the *max* over its buckets, not the sum: its buckets wait for the same late peer
over overlapping stretches of the same wall-clock time (all are in flight at once while the peer sleeps or
computes), so a sum would count one wait once per bucket; the max is the longest its step was held for a peer.
`waited_for` names the rank that issued that bucket last (None when the rank itself was last: it waited for
nobody). The ends coincide only to within the backend's completion latency and thread wake-ups (gloo: tens to
hundreds of us on loopback, more on a loaded CPU), which is the floor of what this can resolve.

The synchronous-step model (a synchronous step waits for its slowest rank): T_step = max_i T_comp,i + T_comm,
wait_i = max_j T_comp,j - T_comp,i.
"""

from __future__ import annotations

import pandas as pd

WAIT_COLUMNS = ["rank", "step", "wait_s", "waited_for", "wait_bucket", "t_comp_s", "straggle_s", "t_step_s"]


def bucket_waits(buckets: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step, bucket): dur_s = t_end - t_start (s), wait_s = dur_s - the shortest dur_s of that
    bucket over the ranks (s), last_rank = the rank with the shortest one (the last to issue the bucket)."""
    cols = ["rank", "step", "bucket", "dur_s", "wait_s", "last_rank"]
    b = buckets.dropna(subset=["t_start", "t_end"]) if not buckets.empty else buckets
    if b.empty:
        return pd.DataFrame(columns=cols)
    b = b[["rank", "step", "bucket", "t_start", "t_end"]].copy()
    b["dur_s"] = b["t_end"] - b["t_start"]
    g = b.groupby(["step", "bucket"])["dur_s"]
    b["wait_s"] = b["dur_s"] - g.transform("min")
    last = b.loc[g.idxmin(), ["step", "bucket", "rank"]].rename(columns={"rank": "last_rank"})
    return b.merge(last, on=["step", "bucket"], how="left")[cols].reset_index(drop=True)


def rank_waits(buckets: pd.DataFrame, steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (rank, step): wait_s (s, the max of the rank's bucket waits), waited_for (the rank it waited
    for, None if nobody), wait_bucket, and from `steps` (dtlab's step events) when given: t_comp_s (s, compute
    until the last bucket was ready + optimizer, the injected delay included: the rank's effective compute),
    straggle_s (s, the delay injected on the rank; 0 where not recorded) and t_step_s (s)."""
    bw = bucket_waits(buckets)
    if bw.empty:
        return pd.DataFrame(columns=WAIT_COLUMNS)
    top = bw.loc[bw.groupby(["rank", "step"])["wait_s"].idxmax()]
    out = pd.DataFrame(
        {
            "rank": top["rank"].astype(int).values,
            "step": top["step"].astype(int).values,
            "wait_s": top["wait_s"].values,
            "wait_bucket": top["bucket"].values,
        }
    )
    who = top["last_rank"].astype(int).values
    out["waited_for"] = pd.array([None if w == r else int(w) for w, r in zip(who, out["rank"])], dtype="Int64")
    if steps is not None and not steps.empty:
        last_ready = buckets.groupby(["rank", "step"], as_index=False)["t_ready"].max()
        st = steps[["rank", "step", "t_opt", "t_step"]].copy()
        st["straggle_s"] = steps["straggle_s"].fillna(0.0) if "straggle_s" in steps.columns else 0.0
        st = st.merge(last_ready, on=["rank", "step"], how="left")
        st["t_comp_s"] = st["t_ready"] + st["t_opt"]
        out = out.merge(
            st.rename(columns={"t_step": "t_step_s"})[["rank", "step", "t_comp_s", "straggle_s", "t_step_s"]],
            on=["rank", "step"],
            how="left",
        )
    for c in WAIT_COLUMNS:
        if c not in out.columns:
            out[c] = float("nan")
    return out[WAIT_COLUMNS].sort_values(["rank", "step"]).reset_index(drop=True)


def run_waits(run, measured_only: bool = True) -> pd.DataFrame:
    """`rank_waits` for a loaded DDP `Run` (steps >= its warmup unless measured_only=False)."""
    steps = run.measured_steps() if measured_only else run.steps
    w = rank_waits(run.buckets, run.steps)
    return w[w["step"].isin(steps["step"])].reset_index(drop=True)


def wait_summary(waits: pd.DataFrame) -> pd.DataFrame:
    """Per rank, medians over the steps of a `rank_waits` frame (s): t_comp_s, straggle_s, wait_s, t_step_s,
    plus waited_for (the rank it waited for in more than half of the steps, else None) and steps (how many)."""
    rows = []
    for rank, g in waits.groupby("rank"):
        who = g["waited_for"].dropna()
        rows.append(
            {
                "rank": int(rank),
                **{c: float(g[c].median()) for c in ("t_comp_s", "straggle_s", "wait_s", "t_step_s")},
                "waited_for": int(who.mode().iloc[0]) if len(who) > len(g) / 2 else None,
                "steps": len(g),
            }
        )
    out = pd.DataFrame(rows, columns=["rank", "t_comp_s", "straggle_s", "wait_s", "t_step_s", "waited_for", "steps"])
    out["waited_for"] = out["waited_for"].astype("Int64")
    return out


def wait_table(run) -> str:
    """Per-rank medians of a straggler run as aligned text (ms): compute, injected delay, wait, whom for."""
    s = wait_summary(run_waits(run))
    lines = [
        f"  stragglers {run.config.stragglers.slow!r}: per rank, medians over measured steps "
        "(wait = time its all-reduces waited for the last rank to join)"
    ]
    for r in s.itertuples():
        who = "nobody" if pd.isna(r.waited_for) else f"rank {int(r.waited_for)}"
        lines.append(
            f"    rank {r.rank}: compute {(r.t_comp_s - r.straggle_s) * 1e3:8.1f} ms   injected "
            f"{r.straggle_s * 1e3:8.1f} ms   waited {r.wait_s * 1e3:8.1f} ms for {who}"
        )
    return "\n".join(lines)


def sync_step_model(t_comp_s, t_comm_s: float = 0.0) -> pd.DataFrame:
    """The synchronous step: every rank's step takes the slowest rank's compute plus the communication.

    `t_comp_s`: per-rank compute in seconds (a sequence indexed by rank, or {rank: s}); `t_comm_s`: T_comm (s).
    Returns rank, t_comp_s, wait_s = max_j T_comp,j - T_comp,i, t_step_s = max_j T_comp,j + T_comm, and
    waited_for (the slowest rank, None for the slowest itself). Example: [1.0, 1.2, 1.1] -> waits 0.2, 0, 0.1.
    """
    comp = dict(t_comp_s) if isinstance(t_comp_s, dict) else dict(enumerate(t_comp_s))
    if not comp:
        raise ValueError("t_comp_s must give at least one rank's compute time (s)")
    if any(not (float(v) >= 0) for v in comp.values()) or not float(t_comm_s) >= 0:
        raise ValueError(f"compute and communication times must be >= 0 s, got {comp} and {t_comm_s!r}")
    slowest = max(comp, key=lambda r: comp[r])
    top = float(comp[slowest])
    out = pd.DataFrame(
        [
            {
                "rank": int(r),
                "t_comp_s": float(c),
                "wait_s": top - float(c),
                "t_step_s": top + float(t_comm_s),
                "waited_for": None if r == slowest else int(slowest),
            }
            for r, c in sorted(comp.items())
        ]
    )
    out["waited_for"] = out["waited_for"].astype("Int64")
    return out
