"""Real runs over a grid of strategies, GPU counts and bucket sizes, one after another, as a tidy DataFrame."""

from __future__ import annotations

import itertools
import json
import os
import time

import pandas as pd

from dtlab.config.run import RunConfig
from dtlab.launching.handle import run as run_one
from dtlab.model.whatif import config_label
from dtlab.results.run import load_run
from dtlab.results.status import RunFailed, recorded_status
from dtlab.results.upgrade import upgrade

SWEEP_COLUMNS = [
    "label",
    "strategy",
    "nproc",
    "bucket_mb",
    "status",
    "reason",
    "t_step",
    "t_comp",
    "t_comm",
    "exposed",
    "overlap",
    "t_comp_how",
    "oversubscribed",
    "path",
]


def run_dir_for(root: str, cfg: RunConfig) -> str:
    """Where a sweep keeps the run of `cfg`: one folder per grid point."""
    return os.path.join(root, f"{cfg.strategy}-{cfg.model}-p{cfg.nproc}-b{cfg.ddp.bucket_mb:g}")


def _same_config(path: str, cfg: RunConfig) -> bool:
    try:
        with open(os.path.join(path, "config.json")) as f:
            old = upgrade(json.load(f)["config"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    status = recorded_status(path, int(old.get("nnodes") or 1))[0] or {}
    return status.get("state") == "finished" and {**old, "out": None} == {**cfg.to_dict(), "out": None}


def sweep(
    base: RunConfig,
    nproc=None,
    bucket_mb=None,
    out: str = "runs/sweep",
    progress: bool = True,
    rerun: bool = False,
    strategy=None,
) -> pd.DataFrame:
    """Run `base` at every (strategy, nproc, bucket_mb) point and return one summary row per point (seconds).

    `strategy` (e.g. ["ddp", "ps"]: ring all-reduce vs parameter server), `nproc` and `bucket_mb` are lists;
    None keeps base's value. `oversubscribed` flags CPU runs with more ranks than cores (their compute and
    communication share the cores: read their times as such, see dtlab.model.ps).

    A finished run with the same config under `out` is reused, not rerun (unless rerun=True). A pair the
    machine cannot host (e.g. more ranks than GPUs under NCCL) is skipped with the reason in `reason`; a run
    that fails is reported with status 'failed' and the error, and the sweep goes on. A run whose exposed time is
    inside the machine's noise has no `exposed` or `overlap` (NaN), and `reason` says so with the noise's size
    (dtlab.results.breakdown)."""
    from tqdm.auto import tqdm  # imports IPython and ipywidgets where present: only when a sweep runs

    nprocs = list(nproc) if nproc is not None else [base.nproc]
    buckets = list(bucket_mb) if bucket_mb is not None else [base.ddp.bucket_mb]
    strategies = list(strategy) if strategy is not None else [base.strategy]
    # strategies innermost: the runs compared with each other run back to back, under the same machine load
    grid = list(itertools.product(nprocs, buckets, strategies))
    rows = []
    bar = tqdm(grid, desc="sweep", unit="run", disable=not progress)
    for p, b, st in bar:
        bar.set_postfix_str(f"{st}, p={p}, bucket {b:g} MiB")
        row = {"label": config_label(p, b), "strategy": st, "nproc": p, "bucket_mb": b, "status": "", "reason": ""}
        try:
            cfg = base.replace(strategy=st, nproc=p, bucket_mb=float(b))
            cfg = cfg.replace(out=run_dir_for(out, cfg))
            cfg.validate()
        except ValueError as e:
            rows.append({**row, "status": "skipped", "reason": str(e)})
            bar.write(f"skipped {st}, p={p}, bucket {b:g} MiB: {e}")
            continue
        try:
            if not rerun and _same_config(cfg.out, cfg):
                run, status = load_run(cfg.out), "reused"
            else:
                if os.path.exists(cfg.out):  # an unfinished or different run here: keep it, aside
                    os.rename(cfg.out, f"{cfg.out}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
                run, status = run_one(cfg, progress=False), "ran"
        except RunFailed as e:
            rows.append({**row, "status": "failed", "reason": f"rank {e.rank}: {e.error}", "path": cfg.out})
            continue
        s = run.summary().set_index("quantity")
        exposed = s.loc["exposed", "value"]
        if exposed != exposed and "noise" in s.loc["exposed", "how"]:  # no figure: the sentence says why
            row["reason"] = f"exposed: {s.loc['exposed', 'how']}"
        rows.append(
            {
                **row,
                "status": status,
                "t_step": s.loc["T_step", "value"],
                "t_comp": s.loc["T_comp", "value"],
                "t_comm": s.loc["T_comm", "value"],
                "exposed": s.loc["exposed", "value"],
                "overlap": s.loc["overlap", "value"],
                "t_comp_how": s.loc["T_comp", "how"],
                "oversubscribed": bool(run.resolved.get("oversubscribed")),
                "path": run.path,
            }
        )
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS)
