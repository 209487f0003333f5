"""Is a parallel run the same training as one process? A run with `reference=True` trained, on every rank, an
unparallelised copy of the model on each step's global batch (dtlab.rank.reference); this module reads the
records back and says how the two agree (`agreement`). Pure.

Per step: the run's loss (the mean over the ranks that hold one: every rank of a tensor-parallel replica, the
last stage of a pipeline, every FSDP2 rank for its own share of the batch, whose mean is the global batch's
loss) beside the copy's, and per rank the gradient ratio <g, r> / <r, r> and relative error |g - r| / |r|.

Tolerances (float32, different summation orders; measured here with AdamW over a few steps: losses within
1e-7 relative, gradients within 5e-6): LOSS_RTOL on the loss, GRAD_TOL on |ratio - 1| and on the relative error.
The agreement names the known failure: a ratio near the number of ranks averaging the gradient is gradients summed
instead of averaged (reported for FSDP2 on gloo, github.com/pytorch/pytorch/issues/162338).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

LOSS_RTOL = 1e-5
GRAD_TOL = 1e-4


@dataclass
class ReferenceCheck:
    """`agreement` with the single process: 'equal', 'summed' or 'differs'; `why` in words; `steps`: one row per step
    (loss, ref_loss, loss_rel_diff, grad_ratio_min / _max over ranks, grad_rel_err_max); `world` the ranks averaging
    a gradient."""

    agreement: str
    why: str
    steps: pd.DataFrame
    world: int

    @property
    def ok(self) -> bool:
        """The run trained as one process would."""
        return self.agreement == "equal"


def step_table(references: pd.DataFrame) -> pd.DataFrame:
    """Per step: loss (the mean over ranks holding one; the `reference` records carry each rank's), ref_loss,
    loss_rel_diff, grad_ratio_min, grad_ratio_max, grad_rel_err_max."""
    if references.empty:
        raise ValueError("no reference records: run with reference=True (and dropout=0)")
    rows = []
    for step, g in references.groupby("step"):
        losses = g["loss"].dropna().astype(float)
        ref = float(g["ref_loss"].iloc[0])
        loss = float(losses.mean()) if len(losses) else np.nan
        rows.append(
            {
                "step": int(step),
                "loss": loss,
                "ref_loss": ref,
                "loss_rel_diff": abs(loss - ref) / abs(ref) if ref else np.nan,
                "grad_ratio_min": float(g["grad_ratio"].min()),
                "grad_ratio_max": float(g["grad_ratio"].max()),
                "grad_rel_err_max": float(g["grad_rel_err"].max()),
            }
        )
    return pd.DataFrame(rows)


def agreement(table: pd.DataFrame, world: int, loss_rtol: float = LOSS_RTOL, grad_tol: float = GRAD_TOL):
    """('equal' | 'summed' | 'differs', why) for a `step_table`; `world`: the ranks that average each gradient
    (the data-parallel degree)."""
    lo, hi = float(table["grad_ratio_min"].min()), float(table["grad_ratio_max"].max())
    if world > 1 and abs(hi / world - 1) < 0.01:
        return "summed", (
            f"gradients are {hi:.4g} x the single-process ones on {world} ranks: summed over the ranks "
            "instead of averaged (reported for FSDP2 on gloo, "
            "github.com/pytorch/pytorch/issues/162338)"
        )
    bad_grad = table[
        ((table["grad_ratio_min"] - 1).abs() > grad_tol)
        | ((table["grad_ratio_max"] - 1).abs() > grad_tol)
        | (table["grad_rel_err_max"] > grad_tol)
        | table["grad_rel_err_max"].isna()
    ]
    bad_loss = table[~(table["loss_rel_diff"] <= loss_rtol)]
    if len(bad_grad):
        r = bad_grad.iloc[0]
        return "differs", (
            f"step {int(r['step'])}: gradient ratio {r['grad_ratio_min']:.6g}..{r['grad_ratio_max']:.6g},"
            f" relative error {r['grad_rel_err_max']:.3g} (tolerance {grad_tol:g})"
        )
    if len(bad_loss):
        r = bad_loss.iloc[0]
        return "differs", (
            f"step {int(r['step'])}: loss {r['loss']:.7g} against the single process's "
            f"{r['ref_loss']:.7g} (relative {r['loss_rel_diff']:.3g}, tolerance {loss_rtol:g})"
        )
    return "equal", (
        f"every step's loss within {loss_rtol:g} (relative) of one process's on the global batch, "
        f"gradient ratios {lo:.7g}..{hi:.7g} and relative errors at most "
        f"{float(table['grad_rel_err_max'].max()):.2g} (tolerance {grad_tol:g})"
    )


def check(run, loss_rtol: float = LOSS_RTOL, grad_tol: float = GRAD_TOL) -> ReferenceCheck:
    """The run's `ReferenceCheck` (ValueError when it was run without reference)."""
    table = step_table(run.references)
    world = int(run.resolved.get("layout", {}).get("dp", run.nproc))
    v, why = agreement(table, world, loss_rtol, grad_tol)
    return ReferenceCheck(v, why, table, world)
