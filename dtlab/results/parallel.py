"""Tables of the strategies beyond data parallelism, read from their recorded collectives. Pure.

- `tp_collectives(run)`: a tensor-parallel run's all-reduces per rank and step, by phase, beside the form (4 per
  block, 2 forward and 2 backward, each of b x s x h activations: dtlab.model.parallel), and whether every
  rank-step matches it.
- `phase_bytes(run)`: any collective-recording run's ops per phase (count and bytes per rank and steady step): FSDP2
  beside ZeRO-3, a pipeline's sends and receives.
- `memory_table(runs)`: what each rank held (parameters, gradients, optimizer state, peak), per run.
"""

from __future__ import annotations

import pandas as pd

from dtlab.model.parallel import tp_allreduce_bytes, tp_allreduces


def _steady(run) -> pd.DataFrame:
    c = run.collectives
    return c[(c["step"] >= run.warmup)] if not c.empty else c


def tp_collectives(run) -> pd.DataFrame:
    """One row per (rank, step) of a 'tp' run: all-reduces on the tensor-parallel axis in forward and backward,
    their bytes, the form's count (4 L) and bytes per all-reduce (b s h x 4), and `matches`."""
    c = run.collectives
    if c.empty or "axis" not in c.columns:
        raise ValueError(f"run {run.path} recorded no collectives with an axis (strategy 'tp')")
    tp = c[(c["axis"] == "tp") & (c["op"] == "all_reduce") & (c["step"] >= 0)]
    L = int(run.resolved["n_layers"])
    each = tp_allreduce_bytes(run.config.batch_size, run.config.seq_len, int(run.resolved["hidden"]))
    rows = []
    for (rank, step), g in tp.groupby(["rank", "step"]):
        f, b = g[g["phase"] == "forward"], g[g["phase"] == "backward"]
        rows.append(
            {
                "rank": int(rank),
                "step": int(step),
                "forward": len(f),
                "backward": len(b),
                "count": len(g),
                "bytes": int(g["nbytes"].sum()),
                "bytes_min": int(g["nbytes"].min()),
                "bytes_max": int(g["nbytes"].max()),
                "form_count": tp_allreduces(L),
                "form_bytes_each": each,
                "matches": len(f) == 2 * L and len(b) == 2 * L and bool((g["nbytes"] == each).all()),
            }
        )
    return pd.DataFrame(rows)


def per_layer(run, rank: int = 0, step: int | None = None) -> pd.DataFrame:
    """One steady step's tensor-parallel collectives on one rank, in order: phase, layer, sublayer, bytes and
    times (s from the step start; t_wait from the blocked record)."""
    c = run.collectives
    step = max(int(run.warmup), 0) if step is None else step
    g = c[(c["rank"] == rank) & (c["step"] == step) & (c["axis"] == "tp")].sort_values("t_start")
    return g[["phase", "layer", "sublayer", "op", "nbytes", "t_start", "t_end"]].reset_index(drop=True)


def phase_bytes(run) -> pd.DataFrame:
    """Per (phase, op): collectives and bytes per rank in one steady step (the median over measured rank-steps),
    in the nccl-tests convention (all-gather: output; reduce-scatter: input)."""
    c = _steady(run)
    if c.empty:
        return pd.DataFrame(columns=["phase", "op", "count", "bytes"])
    per = c.groupby(["rank", "step", "phase", "op"]).agg(count=("nbytes", "size"), bytes=("nbytes", "sum"))
    out = per.groupby(["phase", "op"]).median().reset_index()
    out[["count", "bytes"]] = out[["count", "bytes"]].round().astype(int)
    order = {"forward": 0, "backward": 1, "optimizer": 2}
    return out.sort_values(["phase", "op"], key=lambda s: s.map(order) if s.name == "phase" else s).reset_index(
        drop=True
    )


def memory_table(runs: dict) -> pd.DataFrame:
    """Per run (label -> run): bytes one rank held (the median over ranks of its last memory record)."""
    rows = []
    for label, run in runs.items():
        m = run.memory
        med = m[["params_bytes", "grads_bytes", "opt_bytes", "peak_bytes"]].astype(float).median()
        rows.append(
            {
                "label": label,
                "strategy": run.config.strategy,
                "ranks": run.nproc,
                "params_bytes": med["params_bytes"],
                "grads_bytes": med["grads_bytes"],
                "opt_bytes": med["opt_bytes"],
                "states_bytes": med["params_bytes"] + med["grads_bytes"] + med["opt_bytes"],
                "peak_bytes": med["peak_bytes"],
                "peak_kind": m["peak_kind"].dropna().iloc[0] if m["peak_kind"].notna().any() else None,
            }
        )
    return pd.DataFrame(rows)
