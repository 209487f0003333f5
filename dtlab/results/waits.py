"""One definition of a step's wait for every strategy, so two strategies can stand side by side.

A run's summary (dtlab.results.breakdown) measures exposed communication the way each strategy allows: DDP against
its no-op-hook baseline steps (T_step - T_comp), ZeRO-3 as the time its ranks were blocked on collectives (it has no
baseline). Set beside each other those are two definitions. :func:`blocked_table` uses the one both runs record:

- **waiting** (per measured step, the slowest rank): DDP: from the moment its last bucket became ready (the last
  gradient computed) to the end of the step's compute, i.e. DDP's end-of-backward wait for its all-reduces;
  ZeRO-3: the time the training thread (on a GPU, the compute stream) was blocked on collectives (`t_blocked`);
- **T_comp** = T_step - waiting; **T_comm** = the union of the intervals collectives were in flight;
  **overlap** = 1 - waiting / T_comm.

Medians over the measured steps; seconds. Pure (reads a run's DataFrames).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

#: how the wait of each kind of run was measured, in the table's words
HOW = {
    "buckets": "DDP: the end of backward after the last bucket was ready (the wait for its all-reduces)",
    "blocked": "blocked on collectives: each async collective's wait, a blocking one for its duration",
}


def step_waits(run) -> pd.DataFrame:
    """One row per measured step: step, t_step, t_comm, waiting (s) and how the wait was measured (a HOW key);
    empty when the run recorded neither buckets nor blocked time."""
    ps = run.per_step()
    if ps.empty:
        return pd.DataFrame(columns=["step", "t_step", "t_comm", "waiting", "how"])
    if "t_blocked" in ps.columns:
        waiting, how = ps["t_blocked"].to_numpy(dtype=float), "blocked"
    elif not run.buckets.empty:
        waiting, how = (ps["t_step"] - ps["t_comp_est"]).clip(lower=0.0).to_numpy(dtype=float), "buckets"
    else:
        return pd.DataFrame(columns=["step", "t_step", "t_comm", "waiting", "how"])
    return pd.DataFrame(
        {"step": ps["step"], "t_step": ps["t_step"], "t_comm": ps["t_comm"], "waiting": waiting, "how": how}
    )


def blocked_table(runs: dict) -> pd.DataFrame:
    """{label: Run} -> one row per run under the one definition of the module's docstring: steps, T_step, waiting,
    T_comp, T_comm (ms, medians over measured steps), overlap, and how the wait was measured."""
    rows = []
    for label, run in runs.items():
        w = step_waits(run)
        if w.empty:
            continue
        med = {k: float(np.median(w[k])) for k in ("t_step", "t_comm", "waiting")}
        t_comp = float(np.median(w["t_step"] - w["waiting"]))
        overlap = 1 - med["waiting"] / med["t_comm"] if med["t_comm"] > 0 else float("nan")
        rows.append(
            {
                "run": label,
                "steps": len(w),
                "T_step (ms)": med["t_step"] * 1e3,
                "waiting (ms)": med["waiting"] * 1e3,
                "T_comp = T_step - waiting (ms)": t_comp * 1e3,
                "T_comm (ms)": med["t_comm"] * 1e3,
                "overlap = 1 - waiting / T_comm": overlap,
                "waiting, measured as": HOW[w["how"].iloc[0]],
            }
        )
    return pd.DataFrame(rows)
