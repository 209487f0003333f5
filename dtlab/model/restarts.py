"""Checkpoint cost vs work lost: how often to checkpoint (pure; seconds throughout).

Checkpointing every N steps of t_step seconds (interval tau = N t_step) costs C seconds per checkpoint; a failure
throws away the work since the last checkpoint, on average tau / 2 (failures arrive at random within an
interval), plus R seconds to restart (notice the failure, start new processes, rebuild, load). With failures
every M seconds on average (the MTBF), the fraction of time wasted is, to first order,

    waste(tau) = C / tau + (tau / 2 + R) / M,

smallest at Young's interval tau* = sqrt(2 C M) (J. W. Young, "A first order approximation to the optimum
checkpoint interval", Communications of the ACM 17(9):530-531, 1974). J. T. Daly's higher-order estimate ("A higher
order estimate of the optimum checkpoint interval for restart dumps", Future Generation Computer Systems
22(3):303-312, 2006) is tau* = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C for C < 2M, and M
otherwise; the two agree while C << M.

`measured_costs(run)` reads C, the checkpoint size, t_step and what a restart really cost from a recorded run
(dtlab.results.restarts); `checkpoint_tradeoff` tabulates the trade-off for a few N.
"""

from __future__ import annotations

import math

import pandas as pd


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval sqrt(2 C M), in seconds (C: checkpoint cost, M: MTBF, both s)."""
    if checkpoint_s < 0 or mtbf_s <= 0:
        raise ValueError(f"checkpoint_s must be >= 0 and mtbf_s > 0 (seconds), got {checkpoint_s}, {mtbf_s}")
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum interval (compute time between checkpoints), in seconds; M when C >= 2M."""
    c, m = checkpoint_s, mtbf_s
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return young_interval(c, m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def checkpoint_tradeoff(
    t_step_s: float, checkpoint_s: float, mtbf_s: float, every=(1, 10, 100, 1000), restart_s: float = 0.0
) -> pd.DataFrame:
    """One row per checkpoint interval N (steps): interval_s (N t_step), save_overhead (C / interval, fraction of
    the time spent saving), lost_per_failure_s (N/2 steps x t_step + restart_s: expected work lost per failure),
    waste (save_overhead + lost_per_failure_s / MTBF: fraction of the run lost to both). `attrs` carries Young's
    and Daly's optimum N (their intervals divided by t_step)."""
    if t_step_s <= 0:
        raise ValueError(f"t_step_s must be > 0 (seconds), got {t_step_s}")
    rows = []
    for n in every:
        tau = n * t_step_s
        lost = n / 2.0 * t_step_s + restart_s
        rows.append(
            {
                "every": n,
                "interval_s": tau,
                "save_overhead": checkpoint_s / tau,
                "lost_per_failure_s": lost,
                "waste": checkpoint_s / tau + lost / mtbf_s,
            }
        )
    df = pd.DataFrame(rows)
    df.attrs.update(
        young_every=young_interval(checkpoint_s, mtbf_s) / t_step_s,
        daly_every=daly_interval(checkpoint_s, mtbf_s) / t_step_s,
        mtbf_s=mtbf_s,
        checkpoint_s=checkpoint_s,
        t_step_s=t_step_s,
        restart_s=restart_s,
    )
    return df


def measured_costs(run) -> dict:
    """What checkpoints and restarts cost in a recorded run (a dtlab Run), seconds and bytes:

    - checkpoint_s: median over checkpoints of the slowest rank's save time (the group waits for it);
    - checkpoint_bytes: median bytes per checkpoint, summed over ranks (each rank writes its share);
    - checkpoints: how many were saved; t_step: median step time of the slowest rank (s);
    - restarts, lost_steps (steps redone), lost_s (their time, slowest rank per step) and down_s (per restart, the
      slowest rank's time from its last record before the failure to its resume), lost_total_s = lost_s + down_s.
    """
    ck = run.checkpoints
    per = ck.groupby(["attempt", "step"]) if not ck.empty else None
    st = run.steps.groupby("step")["t_step"].max() if not run.steps.empty else pd.Series(dtype=float)
    lost_s = float(run.lost.groupby(["attempt", "step"])["t_step"].max().sum()) if not run.lost.empty else 0.0
    down_s = float(run.restarts.groupby("attempt")["down_s"].max().sum()) if not run.restarts.empty else 0.0
    return {
        "checkpoint_s": float(per["t_save"].max().median()) if per is not None else float("nan"),
        "checkpoint_bytes": float(per["nbytes"].sum().median()) if per is not None else float("nan"),
        "checkpoints": per.ngroups if per is not None else 0,
        "t_step": float(st.median()) if len(st) else float("nan"),
        "restarts": int(run.restarts["attempt"].nunique()) if not run.restarts.empty else 0,
        "lost_steps": int(run.lost[["attempt", "step"]].drop_duplicates().shape[0]) if not run.lost.empty else 0,
        "lost_s": lost_s,
        "down_s": down_s,
        "lost_total_s": lost_s + down_s,
    }
