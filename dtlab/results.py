"""Reading a run directory back: `load_run(path) -> Run` with pandas DataFrames and `summary()`.

Pure (no torch): safe to import anywhere, fast to test. This is the only reader of run directories.

Definitions used everywhere (seconds; each measured step is first reduced over ranks, then the median is
taken over the measured steps, i.e. steps >= config.warmup):

- T_step: wall time of one optimizer step (forward + backward + optimizer) on the slowest rank.
- T_comp: the same step with communication removed, measured with DDP's no-op comm hook
  (`baseline_steps`); without a baseline it is estimated as forward + backward up to the moment the last
  gradient bucket became ready + optimizer, and labelled "estimated".
- T_comm: time collectives are in flight in a step: the length of the union of the [t_start, t_end]
  intervals of the step's buckets (or ZeRO-3 collectives), on the rank where it is longest.
- Exposed communication: T_step - T_comp, the part of T_comm that overlap did not hide.
- Overlap: 1 - exposed / T_comm (1 = fully hidden, 0 = fully exposed; noise can push it past either end).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

STEP_COLUMNS = ["rank", "step", "t_fwd", "t_bwd", "t_opt", "t_step", "loss"]
BUCKET_COLUMNS = ["rank", "step", "bucket", "nbytes", "nparams", "t_ready", "t_start", "t_end"]
COLLECTIVE_COLUMNS = ["rank", "step", "op", "nbytes", "phase", "t_start", "t_end"]
MEMORY_COLUMNS = ["rank", "params_bytes", "grads_bytes", "optim_bytes", "peak_bytes", "peak_kind"]


class RunFailed(RuntimeError):
    """A rank raised (or the run was stopped). `rank`, `error`, `traceback_tail` say what happened;
    `run` holds everything recorded before the failure (a partial `Run`), `run_dir` where it lies."""

    def __init__(self, message: str, *, rank=None, error=None, traceback_tail=None, run_dir=None, run=None):
        super().__init__(message)
        self.rank, self.error, self.traceback_tail = rank, error, traceback_tail
        self.run_dir, self.run = run_dir, run


def read_events(path: str) -> list[dict]:
    """Parse one rank's JSONL events; a torn last line (crash mid-write) is skipped, not fatal."""
    out = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
    return out


@dataclass
class Run:
    """A run directory loaded into DataFrames (seconds and bytes throughout)."""

    path: str
    config: dict
    resolved: dict
    status: dict
    steps: pd.DataFrame
    baseline_steps: pd.DataFrame
    buckets: pd.DataFrame
    collectives: pd.DataFrame
    memory: pd.DataFrame
    errors: list = field(default_factory=list)
    ddp_logging: dict = field(default_factory=dict)

    @property
    def warmup(self) -> int:
        return int(self.config.get("warmup", 0))

    @property
    def nproc(self) -> int:
        return int(self.resolved.get("world_size", self.config.get("nproc", 1)))

    def measured_steps(self) -> pd.DataFrame:
        """`steps` without the warm-up steps."""
        return self.steps[self.steps["step"] >= self.warmup]

    def per_step(self) -> pd.DataFrame:
        """One row per measured step: t_step (slowest rank), t_comm (longest in-flight union across ranks),
        t_comp_est (estimated compute on the slowest rank), seconds."""
        st = self.measured_steps()
        if st.empty:
            return pd.DataFrame(columns=["step", "t_step", "t_comm", "t_comp_est"])
        comm = self.comm_intervals()
        rows = []
        for step, g in st.groupby("step"):
            slow = g.loc[g["t_step"].idxmax()]
            c = comm[comm["step"] == step] if not comm.empty else comm
            t_comm = c.groupby("rank").apply(_union_length, include_groups=False).max() if not c.empty else 0.0
            last_ready = self._compute_end(int(slow["rank"]), step, float(slow["t_fwd"] + slow["t_bwd"]))
            rows.append({"step": step, "t_step": float(slow["t_step"]), "t_comm": float(t_comm),
                         "t_comp_est": last_ready + float(slow["t_opt"])})
        return pd.DataFrame(rows)

    def comm_intervals(self) -> pd.DataFrame:
        """rank, step, t_start, t_end of every recorded collective (DDP buckets or ZeRO-3 collectives)."""
        frames = [df[["rank", "step", "t_start", "t_end"]] for df in (self.buckets, self.collectives) if not df.empty]
        return pd.concat(frames, ignore_index=True).dropna() if frames else pd.DataFrame(
            columns=["rank", "step", "t_start", "t_end"])

    def _compute_end(self, rank: int, step: int, default: float) -> float:
        if self.buckets.empty:
            return default
        b = self.buckets[(self.buckets["rank"] == rank) & (self.buckets["step"] == step)]
        return float(b["t_ready"].max()) if not b.empty else default

    def summary(self) -> pd.DataFrame:
        """Medians over measured steps of T_step, T_comp, T_comm, exposed communication and overlap.

        Columns: quantity, value, unit, how (where the number comes from). See the module docstring for
        the definitions."""
        ps = self.per_step()
        t_step = float(ps["t_step"].median()) if not ps.empty else np.nan
        t_comm = float(ps["t_comm"].median()) if not ps.empty else np.nan
        how_exposed, how_overlap = "T_step - T_comp", "1 - exposed / T_comm"
        if not self.baseline_steps.empty:
            t_comp = float(self.baseline_steps.groupby("step")["t_step"].max().median())
            how_comp = f"measured: median of {self.baseline_steps['step'].nunique()} no-op comm hook steps"
        elif not self.collectives.empty and self.buckets.empty:
            # ZeRO-3 has no no-op baseline: its collectives are part of the forward/backward code path.
            t_comp = float((ps["t_step"] - ps["t_comm"]).median()) if not ps.empty else np.nan
            how_comp = "estimated: T_step - T_comm (ZeRO-3 has no no-op baseline; assumes no overlap)"
            how_exposed, how_overlap = "assumed = T_comm (no baseline to measure it against)", "not measured"
        else:
            t_comp = float(ps["t_comp_est"].median()) if not ps.empty else np.nan
            how_comp = "estimated: fwd + bwd until the last bucket was ready + opt (no baseline run)"
        exposed = t_comm if how_overlap == "not measured" else t_step - t_comp
        overlap = 1.0 - exposed / t_comm if t_comm > 0 and how_overlap != "not measured" else np.nan
        n = len(ps)
        return pd.DataFrame([
            ("T_step", t_step, "s", f"median over {n} steps of the slowest rank's step time"),
            ("T_comp", t_comp, "s", how_comp),
            ("T_comm", t_comm, "s", "median of the time collectives were in flight per step"),
            ("exposed", exposed, "s", how_exposed),
            ("overlap", overlap, "fraction", how_overlap),
        ], columns=["quantity", "value", "unit", "how"])

    def breakdown_table(self) -> str:
        """The summary as aligned text, times in milliseconds, plus where model and data came from."""
        s = self.summary()
        lines = [f"run {self.path}",
                 f"  {self.config.get('strategy')} | {self.resolved.get('backend', '?')} | {self.nproc} ranks | "
                 + (f"bucket {self.config.get('bucket_mb')} MiB | " if self.config.get("strategy") == "ddp" else "")
                 + f"batch {self.config.get('batch_size')}/rank | "
                 f"seq_len {self.config.get('seq_len')} | status {self.status.get('state', '?')}",
                 f"  model: {self.resolved.get('model_source', '?')}",
                 f"  data:  {self.resolved.get('data_source', '?')}"]
        if self.resolved.get("oversubscribed"):
            lines.append(f"  note: {self.nproc} ranks on {self.resolved.get('cpu_cores')} CPU cores "
                         "(oversubscribed: compute is slowed by sharing cores)")
        for r in s.itertuples():
            if r.value != r.value:  # NaN: not measured
                val = f"{'n/a':>10}   "
            else:
                val = f"{r.value * 1e3:10.1f} ms" if r.unit == "s" else f"{r.value:10.2f}   "
            lines.append(f"  {r.quantity:<8}{val}   {r.how}")
        return "\n".join(lines)


def _union_length(df: pd.DataFrame) -> float:
    """Length of the union of [t_start, t_end] intervals (concurrent collectives counted once)."""
    iv = sorted(zip(df["t_start"], df["t_end"]))
    total, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def load_run(path: str) -> Run:
    """Load a run directory (finished, failed or still running) into a `Run`."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path} is not a dtlab run directory (no config.json)")
    with open(cfg_path) as f:
        doc = json.load(f)
    status = {}
    if os.path.isfile(os.path.join(path, "status.json")):
        with open(os.path.join(path, "status.json")) as f:
            status = json.load(f)
    rows: dict[str, list] = {k: [] for k in ("step", "baseline_step", "bucket", "collective", "memory", "error")}
    ddp_logging = {}
    for ev_path in sorted(glob.glob(os.path.join(path, "events", "rank*.jsonl"))):
        for ev in read_events(ev_path):
            kind = ev.pop("kind", None)
            if kind in rows:
                rows[kind].append(ev)
            elif kind == "ddp_logging":
                ddp_logging[ev.get("rank")] = ev.get("data", {})
    mem = _frame(rows["memory"], MEMORY_COLUMNS, sort=["rank"])
    if not mem.empty:  # the last memory record per rank is the final one (with the peak)
        mem = mem.groupby("rank", as_index=False).last()
    return Run(
        path=path, config=doc.get("config", {}), resolved=doc.get("resolved", {}), status=status,
        steps=_frame(rows["step"], STEP_COLUMNS), baseline_steps=_frame(rows["baseline_step"], STEP_COLUMNS),
        buckets=_frame(rows["bucket"], BUCKET_COLUMNS, sort=["rank", "step", "t_ready"]),
        collectives=_frame(rows["collective"], COLLECTIVE_COLUMNS, sort=["rank", "step", "t_start"]),
        memory=mem, errors=rows["error"], ddp_logging=ddp_logging)


def _frame(rows: list[dict], columns: list[str], sort: list[str] | None = None) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    for c in columns:
        if c not in df.columns:
            df[c] = pd.Series(dtype=float)
    df = df[columns + [c for c in df.columns if c not in columns and c != "time"]]
    if not df.empty:
        df = df.sort_values(sort or ["rank", "step"], kind="stable").reset_index(drop=True)
    return df
