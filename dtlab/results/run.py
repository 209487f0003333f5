"""Reading a run directory back: `load_run(path) -> Run` with pandas DataFrames and `summary()`.

Pure (no torch): safe to import anywhere, fast to test. This is the only reader of run directories.

Definitions used everywhere (seconds; each measured step is first reduced over ranks, then the median is
taken over the measured steps, i.e. steps >= config.warmup):

- T_step: wall time of one optimizer step (forward + backward + optimizer) on the slowest rank.
- T_comp: the same step with communication removed, measured in `baseline_steps` extra steps whose comm hook
  does everything dtlab's recording hook does except the collective (dtlab.rank.recorder); without a baseline it is estimated as forward + backward up to the moment the last
  gradient bucket became ready + optimizer, and labelled "estimated".
- T_comm: time collectives are in flight in a step: the length of the union of the [t_start, t_end]
  intervals of the step's buckets (or ZeRO-3 collectives), on the rank where it is longest.
- Exposed communication: T_step - T_comp, the part of T_comm that overlap did not hide.
- Overlap: 1 - exposed / T_comm (1 = fully hidden, 0 = fully exposed; noise can push it past either end).

ZeRO-3 (strategy 'zero3') has no no-op baseline, and DeepSpeed overlaps its collectives with compute on side
streams, so T_step - T_comm is not its compute time. There, exposed communication is measured directly:
t_blocked, the time the slowest rank's training thread (CPU) or compute stream (GPU) was blocked waiting for
collectives (timed Work.wait() of async collectives, the whole of blocking ones; see dtlab.rank.strategies.zero3.blocked), and
T_comp = T_step - t_blocked on that rank. T_comm stays the in-flight union. Runs recorded before t_blocked
existed fall back to T_step - T_comm, labelled "assumes no overlap".
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dtlab.config.strategies import strategy_spec
from dtlab.intervals import frame_union_length
from dtlab.results.convergence import convergence_lines, evals_frame, first_at, updates_frame
from dtlab.results.restarts import FRAMES, recovery, restart_lines
from dtlab.runfiles import RunDamageWarning
from dtlab.results.status import read_run_dir, status_lines
from dtlab.units import fmt_mib, fmt_ms

STEP_COLUMNS = ["rank", "step", "t_fwd", "t_bwd", "t_opt", "t_step", "loss"]
BUCKET_COLUMNS = ["rank", "step", "bucket", "nbytes", "nparams", "t_ready", "t_start", "t_end", "backend_ms"]
COLLECTIVE_COLUMNS = ["rank", "step", "op", "nbytes", "phase", "t_start", "t_end"]
BLOCKED_COLUMNS = ["rank", "step", "phase", "op", "how", "seq", "t_start", "t_end"]
MEMORY_COLUMNS = ["rank", "params_bytes", "grads_bytes", "optim_bytes", "peak_bytes", "peak_kind"]
RANK_COLUMNS = ["rank", "node", "local_rank", "host", "pid", "slot"]
DAMAGE_COLUMNS = ["file", "line", "what", "tolerated"]
MICROBATCH_COLUMNS = ["rank", "step", "stage", "microbatch", "phase", "t_start", "t_end"]
REFERENCE_COLUMNS = ["rank", "step", "loss", "ref_loss", "grad_ratio", "grad_rel_err", "grad_max_abs_diff"]


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
    ddp_stats: pd.DataFrame = field(default_factory=pd.DataFrame)
    """DDP's own per-step timers (rank, step, backward_comm_time, ... in seconds): see `crosscheck()`."""
    blocked: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=BLOCKED_COLUMNS))
    """ZeRO-3: intervals a rank was blocked waiting for a collective (see dtlab.rank.strategies.zero3.blocked); empty for DDP."""
    checkpoints: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Checkpoints saved: rank, step (steps done), attempt, t_save (s), nbytes (B this rank wrote); see dtlab.results.restarts."""
    restarts: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per rank per restart: attempt, resumed_from (step), t_load (s), down_s (s); empty without restarts."""
    lost: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Lost work: steps an attempt recorded that a restarted one redid (rank, step, attempt, t_step s, loss)."""
    ranks: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=RANK_COLUMNS))
    """Where each rank ran, from its start event: node (torchrun's node rank), local rank, host, pid, slot; and
    how its events end: 'done', 'error' or 'incomplete' (neither: cut short, or still running)."""
    warnings: list = field(default_factory=list)
    """Recoverable damage found while reading (sentences naming file, line and what); see dtlab.results.status."""
    damage: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=DAMAGE_COLUMNS))
    """One row per event line skipped (tolerated=False) or tolerated (a torn last line): file, line, what."""
    microbatches: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=MICROBATCH_COLUMNS))
    """A pipeline ('pp'): every forward and backward a stage computed, per micro-batch (s from the step start)."""
    references: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=REFERENCE_COLUMNS))
    """With `reference`: per rank and step, the single-process copy's loss and how the rank's gradients compare."""
    evals: pd.DataFrame = field(default_factory=lambda: evals_frame([]))
    """Held-out evaluations (`eval_every`): step, t (s of training time since the first step, evaluations left
    out), accuracy, loss, t_eval, t_wall, n; see dtlab.results.convergence."""
    updates: pd.DataFrame = field(default_factory=lambda: updates_frame([]))
    """Strategy 'async': every pushed gradient the server took: rank (the worker), step, staleness, applied, ..."""

    def time_to(self, accuracy: float) -> float | None:
        """Seconds of training time until the first evaluation at or above `accuracy` (None: never reached)."""
        return first_at(self.evals, accuracy, "t")

    def steps_to(self, accuracy: float) -> int | None:
        """Optimizer steps (the server's updates for 'async') until the first evaluation at or above `accuracy`."""
        return first_at(self.evals, accuracy, "step")

    @property
    def warmup(self) -> int:
        return int(self.config.get("warmup", 0))

    @property
    def nproc(self) -> int:
        return int(self.resolved.get("world_size", self.config.get("nproc", 1)))

    def measured_steps(self) -> pd.DataFrame:
        """`steps` without the warm-up steps."""
        return self.steps[self.steps["step"] >= self.warmup]

    @property
    def spec(self):
        """The run's strategy spec (dtlab.config.strategies): how its communication was recorded."""
        return strategy_spec(self.config.get("strategy"))

    @property
    def measures_blocked(self) -> bool:
        """True for ZeRO-3 runs whose step events carry t_blocked (measured exposed communication)."""
        return (self.spec.blocked_time and "t_blocked" in self.steps.columns
                and self.steps["t_blocked"].notna().any())

    def per_step(self) -> pd.DataFrame:
        """One row per measured step: t_step (slowest rank), t_comm (longest in-flight union across ranks),
        t_comp_est (estimated compute on the slowest rank), seconds. ZeRO-3 runs that measured blocked time
        add t_blocked (the slowest rank's time blocked on collectives) and t_comp_est = t_step - t_blocked."""
        st = self.measured_steps()
        if st.empty:
            return pd.DataFrame(columns=["step", "t_step", "t_comm", "t_comp_est"])
        blocked = self.measures_blocked
        comm = self.comm_intervals()
        rows = []
        for step, g in st.groupby("step"):
            slow = g.loc[g["t_step"].idxmax()]
            c = comm[comm["step"] == step] if not comm.empty else comm
            t_comm = c.groupby("rank").apply(frame_union_length, include_groups=False).max() if not c.empty else 0.0
            last_ready = self._compute_end(int(slow["rank"]), step, float(slow["t_fwd"] + slow["t_bwd"]))
            row = {"step": step, "t_step": float(slow["t_step"]), "t_comm": float(t_comm),
                   "t_comp_est": last_ready + float(slow["t_opt"])}
            if blocked:
                row["t_blocked"] = float(slow["t_blocked"])
                row["t_comp_est"] = row["t_step"] - row["t_blocked"]
            rows.append(row)
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
        exposed_med = None  # set where exposed communication is measured directly (ZeRO-3)
        if not self.baseline_steps.empty:
            t_comp = float(self.baseline_steps.groupby("step")["t_step"].max().median())
            how_comp = f"measured: median of {self.baseline_steps['step'].nunique()} no-op comm hook steps"
        elif self.measures_blocked and "t_blocked" in ps.columns:
            # ZeRO-3 has no no-op baseline; its waits on collectives are timed instead (dtlab.rank.strategies.zero3.blocked).
            exposed_med = float(ps["t_blocked"].median())
            t_comp = float((ps["t_step"] - ps["t_blocked"]).median())
            where = "compute stream" if self.resolved.get("device_type") == "cuda" else "training thread"
            how_comp = "measured: T_step - time blocked on collectives (slowest rank, per step)"
            how_exposed = (f"measured: time the slowest rank's {where} was blocked waiting for collectives "
                           "(timed waits + blocking calls)")
            how_overlap = "1 - exposed / T_comm (exposed measured, T_comm = in-flight union)"
        elif not self.collectives.empty and self.buckets.empty:
            # A ZeRO-3 run recorded before blocked time was measured.
            t_comp = float((ps["t_step"] - ps["t_comm"]).median()) if not ps.empty else np.nan
            how_comp = ("estimated: T_step - T_comm (recorded without blocked-time measurement; assumes no "
                        "overlap)") if self.spec.blocked_time else "estimated: T_step - T_comm (blocking collectives)"
            how_exposed, how_overlap = "assumed = T_comm (no baseline to measure it against)", "not measured"
        else:
            t_comp = float(ps["t_comp_est"].median()) if not ps.empty else np.nan
            how_comp = "estimated: fwd + bwd until the last bucket was ready + opt (no baseline run)"
        if how_overlap == "not measured":
            exposed = t_comm
        elif exposed_med is not None:
            exposed = exposed_med
        else:
            exposed = t_step - t_comp
        overlap = 1.0 - exposed / t_comm if t_comm > 0 and how_overlap != "not measured" else np.nan
        n = len(ps)
        return pd.DataFrame([
            ("T_step", t_step, "s", f"median over {n} steps of the slowest rank's step time"),
            ("T_comp", t_comp, "s", how_comp),
            ("T_comm", t_comm, "s", "median of the time collectives were in flight per step"
             + (" (union of intervals on the rank where longest)" if self.spec.records == "collectives" else "")),
            ("exposed", exposed, "s", how_exposed),
            ("overlap", overlap, "fraction", how_overlap),
        ], columns=["quantity", "value", "unit", "how"])

    def bubble(self):
        """A pipeline run's measured bubble beside the (P-1)/(M+P-1) theory: `dtlab.results.pipeline.bubble`."""
        from dtlab.results.pipeline import bubble
        return bubble(self)

    def reference_check(self):
        """How a run with `reference` compares with its single-process copy: `dtlab.results.reference.check`."""
        from dtlab.results.reference import check
        return check(self)

    def to_chrome_trace(self, path: str | None = None):
        """The run as a Chrome / Perfetto trace (one process per rank; compute and communication tracks): the
        dict, or the path written when `path` is given. See `dtlab.results.trace`."""
        from dtlab.results.trace import chrome_trace, write_chrome_trace
        return write_chrome_trace(self, path) if path else chrome_trace(self)

    def crosscheck(self) -> pd.DataFrame:
        """dtlab's communication timings against NCCL's and DDP's own timers: see `dtlab.results.crosscheck`."""
        from dtlab.results.crosscheck import crosscheck
        return crosscheck(self)

    def breakdown_table(self) -> str:
        """The summary as aligned text, times in milliseconds, plus where model and data came from."""
        s = self.summary()
        lines = [f"run {self.path}",
                 f"  {self.config.get('strategy')} | {self.resolved.get('backend', '?')} | {self.nproc} ranks"
                 + (f" on {self.resolved['nnodes']} nodes | " if self.resolved.get("nnodes", 1) > 1 else " | ")
                 + (f"bucket {fmt_mib(self.config.get('bucket_mb'))} MiB | " if self.spec.records == "buckets" else "")
                 + f"batch {self.config.get('batch_size')}/rank | "
                 f"seq_len {self.config.get('seq_len')} | status {self.status.get('state', '?')}",
                 f"  ranks: {self.resolved.get('placement', {}).get('label', self.resolved.get('backend', '?'))}",
                 f"  model: {self.resolved.get('model_source', '?')}",
                 f"  data:  {self.resolved.get('data_source', '?')}"]
        placed = self.resolved.get("placement", {})
        lines += [f"  {k}: {placed[k]}" for k in ("note", "timing") if placed.get(k)]  # what it means, how timed
        if self.resolved.get("oversubscribed"):
            lines.append(f"  note: {self.nproc} ranks on {self.resolved.get('cpu_cores')} CPU cores "
                         "(oversubscribed: compute is slowed by sharing cores)")
        lines += restart_lines(self) + status_lines(self) + convergence_lines(self)
        for r in s.itertuples():
            if r.value != r.value:  # NaN: not measured
                val = fmt_ms(None, width=10)
            else:
                val = fmt_ms(r.value, width=10) if r.unit == "s" else f"{r.value:10.2f}   "
            lines.append(f"  {r.quantity:<8}{val}   {r.how}")
        return "\n".join(lines)


def load_run(path: str) -> Run:
    """Load a run directory (finished, failed or still running) into a `Run`, read strictly by dtlab.results.status:
    damage that can be skipped is a `RunDamageWarning` (also in `run.warnings`, line by line in `run.damage`);
    a config.json that cannot be read, or a missing events/ folder, is a `DamagedRun` naming the file."""
    rec = read_run_dir(path)
    for w in rec.warnings:
        warnings.warn(f"{path}: {w}", RunDamageWarning, stacklevel=2)
    rows: dict[str, list] = {k: [] for k in ("step", "baseline_step", "bucket", "collective", "memory", "error",
                                             "ddp_stats", "blocked", "checkpoint", "restart", "start",
                                             "microbatch", "reference", "eval",
                                             "update")}
    ddp_logging = {}
    for ev in rec.events():
        ev = dict(ev)
        kind = ev.pop("kind", None)
        if kind in rows:
            rows[kind].append(ev)
        elif kind == "ddp_logging":
            ddp_logging[ev.get("rank")] = ev.get("data", {})
    rows, rows_rec = recovery(rows)  # one timeline: what a restarted attempt redid is lost work (dtlab.results.restarts)
    mem = _frame(rows["memory"], MEMORY_COLUMNS, sort=["rank"])
    if not mem.empty:  # the last memory record per rank is the final one (with the peak)
        mem = mem.groupby("rank", as_index=False).last()
    ranks = _frame(rows["start"], RANK_COLUMNS, sort=["rank"]).drop_duplicates("rank", keep="last")  # restarts
    ranks["ended"] = ranks["rank"].map(rec.ended) if not ranks.empty else pd.Series(dtype=object)
    return Run(
        path=path, config=rec.doc["config"], resolved=rec.doc.get("resolved", {}), status=rec.status,
        # `time`: the wall clock each rank stamped at a step's end (s since the epoch), one clock for the ranks of a
        # machine: with t_step it places the ranks' steps side by side (dtlab.model.prediction, the trace export)
        steps=_frame(rows["step"], STEP_COLUMNS + ["time"]),
        baseline_steps=_frame(rows["baseline_step"], STEP_COLUMNS + ["time"]),
        buckets=_frame(rows["bucket"], BUCKET_COLUMNS, sort=["rank", "step", "t_ready"]),
        collectives=_frame(rows["collective"], COLLECTIVE_COLUMNS, sort=["rank", "step", "t_start"]),
        memory=mem, errors=rows["error"], ddp_logging=ddp_logging,
        ddp_stats=_frame(rows["ddp_stats"], ["rank", "step"]),
        blocked=_frame(rows["blocked"], BLOCKED_COLUMNS, sort=["rank", "step", "t_start"]), ranks=ranks,
        warnings=list(rec.warnings), damage=_frame(rec.damage(), DAMAGE_COLUMNS, sort=["file", "line"]),
        microbatches=_frame(rows["microbatch"], MICROBATCH_COLUMNS, sort=["rank", "step", "t_start"]),
        references=_frame(rows["reference"], REFERENCE_COLUMNS),
        evals=evals_frame(rows["eval"]), updates=updates_frame(rows["update"]),
        **{name: _frame(rows_rec[name], cols, sort=[c for c in ("attempt", "step", "rank") if c in cols])
           for name, cols in FRAMES.items()})


def _frame(rows: list[dict], columns: list[str], sort: list[str] | None = None) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    for c in columns:
        if c not in df.columns:
            df[c] = pd.Series(dtype=float)
    df = df[columns + [c for c in df.columns if c not in columns and c != "time"]]
    if not df.empty:
        df = df.sort_values(sort or ["rank", "step"], kind="stable").reset_index(drop=True)
    return df
