"""Reading a run directory back: `load_run(path) -> Run` with pandas DataFrames and `summary()`.

Pure (no torch): safe to import anywhere, fast to test. This is the only reader of run directories.

Definitions used everywhere (seconds; each measured step is first reduced over ranks, then the median is
taken over the measured steps, i.e. steps >= config.warmup):

- T_step: wall time of one optimizer step (forward + backward + optimizer) on the slowest rank.
- T_comp: the same step with communication removed, measured in `baseline_steps` extra steps whose comm hook
  does everything dtlab's recording hook does except the collective (dtlab.rank.recorder), each run right after
  the training step it is paired with (dtlab.config.baseline): T_comp = T_step - exposed. Without a baseline it is
  estimated as forward + backward up to the moment the last gradient bucket became ready + optimizer, and
  labelled "estimated".
- T_comm: time collectives are in flight in a step: the length of the union of the [t_start, t_end]
  intervals of the step's buckets (or ZeRO-3 collectives), on the rank where it is longest.
- Exposed communication: T_step - T_comp, the part of T_comm that overlap did not hide: the median over the pairs
  of (the training step's time - its no-op-hook step's time), both on their slowest rank.
- Overlap: 1 - exposed / T_comm (1 = fully hidden, 0 = fully exposed).

Each figure comes with a 90% bootstrap interval, and an exposed time whose interval is not above 0 is said to be
below the machine's noise instead of shown: dtlab.results.breakdown and dtlab.results.spread.

ZeRO-3 (strategy 'zero3') has no no-op baseline, and DeepSpeed overlaps its collectives with compute on side
streams, so T_step - T_comm is not its compute time. There, exposed communication is measured directly:
t_blocked, the time the slowest rank's training thread (CPU) or compute stream (GPU) was blocked waiting for
collectives (timed Work.wait() of async collectives, the whole of blocking ones; see
dtlab.rank.strategies.zero3.blocked), and T_comp = T_step - t_blocked on that rank. T_comm stays the in-flight
union. Runs recorded before t_blocked existed (their steps carry none; no upgrade can measure it afterwards) fall back
to T_step - T_comm, labelled "assumes no overlap" (dtlab.results.breakdown).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dtlab.config.placement import TIMING_METHODS
from dtlab.config.run import CONFIG_VERSION, RunConfig
from dtlab.config.strategies import strategy_spec
from dtlab.results.breakdown import comm_intervals, per_step, summary, summary_lines, timing_method
from dtlab.results.chrome import chrome_trace, write_chrome_trace
from dtlab.results.columns import read_copy, write_copy
from dtlab.results.convergence import convergence_lines, evals_frame, first_at, updates_frame
from dtlab.results.crosscheck import crosscheck
from dtlab.results.pipeline import bubble
from dtlab.results.reference import check
from dtlab.results.restarts import FRAMES, recovery, restart_lines
from dtlab.results.status import RunRecord, read_doc, read_run_dir, settle_status, status_lines
from dtlab.results.upgrade import upgrade_event
from dtlab.results.whatif import whatif
from dtlab.runfiles import DamagedRun, RunDamageWarning
from dtlab.units import fmt_mib

STEP_COLUMNS = ["rank", "step", "t_fwd", "t_bwd", "t_opt", "t_step", "loss"]
BUCKET_COLUMNS = ["rank", "step", "bucket", "nbytes", "nparams", "t_ready", "t_start", "t_end", "backend_ms"]
COLLECTIVE_COLUMNS = ["rank", "step", "op", "nbytes", "phase", "t_start", "t_end"]
BLOCKED_COLUMNS = ["rank", "step", "phase", "op", "how", "seq", "t_start", "t_end"]
MEMORY_COLUMNS = ["rank", "params_bytes", "grads_bytes", "opt_bytes", "peak_bytes", "peak_kind"]
RANK_COLUMNS = ["rank", "node", "local_rank", "host", "pid", "slot"]
DAMAGE_COLUMNS = ["file", "line", "what", "tolerated"]
MICROBATCH_COLUMNS = ["rank", "step", "stage", "microbatch", "phase", "t_start", "t_end"]
REPR_PATH = 200  # characters of the path `repr(run)` shows (the end of a longer one)
REFERENCE_COLUMNS = ["rank", "step", "loss", "ref_loss", "grad_ratio", "grad_rel_err", "grad_max_abs_diff"]


@dataclass(repr=False)
class Run:
    """A run directory loaded into DataFrames (seconds and bytes throughout). `config` is the run's `RunConfig` in
    the current form, whatever dtlab recorded it (dtlab.results.upgrade), read as the ranks read it:
    `run.config.parallel.microbatches`."""

    path: str
    config: RunConfig
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
    """ZeRO-3: intervals a rank was blocked waiting for a collective (see dtlab.rank.strategies.zero3.blocked); empty
    for DDP."""
    checkpoints: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Checkpoints saved: rank, step (steps done), attempt, t_save (s), nbytes (B this rank wrote); see
    dtlab.results.restarts."""
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
    machine: list = field(default_factory=list)
    """The `machine` events: each rank's CPU time, and rank 0's machine counters, when its steps started and ended
    (dtlab.config.busy); `dtlab.results.busy.machine_load(run)` turns them into other processes' CPU time."""

    def __repr__(self) -> str:
        """One short line: path, strategy, ranks, state (the frames are attributes; `summary()` has the numbers)."""
        path = self.path if len(self.path) <= REPR_PATH else "..." + self.path[-(REPR_PATH - 3) :]
        return (
            f"Run({path!r}, strategy={self.config.strategy!r}, ranks={self.nproc}, "
            f"state={self.status.get('state', '?')!r})"
        )

    def time_to(self, accuracy: float) -> float | None:
        """Seconds of training time until the first evaluation at or above `accuracy` (None: never reached)."""
        return first_at(self.evals, accuracy, "t")

    def steps_to(self, accuracy: float) -> int | None:
        """Optimizer steps (the server's updates for 'async') until the first evaluation at or above `accuracy`."""
        return first_at(self.evals, accuracy, "step")

    @property
    def warmup(self) -> int:
        return int(self.config.warmup)

    @property
    def nproc(self) -> int:
        return int(self.resolved.get("world_size", self.config.nproc or 1))

    @property
    def lr(self) -> float | None:
        """The base learning rate the run trained at (before lr_scaling and the warmup): `resolved["lr"]["value"]`,
        which the rank settled once the model was built (`config["lr"]` None means "auto"; `resolved["lr"]["source"]`
        says why), else `config["lr"]` (None: the run stopped before its rank settled it)."""
        rec = self.resolved.get("lr")
        return float(rec["value"]) if isinstance(rec, dict) and rec.get("value") is not None else self.config.lr

    def measured_steps(self) -> pd.DataFrame:
        """`steps` without the warm-up steps."""
        return self.steps[self.steps["step"] >= self.warmup]

    @property
    def spec(self):
        """The run's strategy spec (dtlab.config.strategies): how its communication was recorded."""
        return strategy_spec(self.config.strategy)

    @property
    def timing_method(self) -> str:
        """How this run's figures were taken ('cuda_events', 'wall_clock', 'wall_clock_synced'), as its ranks
        recorded it: dtlab.results.breakdown.timing_method."""
        return timing_method(self)

    @property
    def timing_how(self) -> str:
        """The recorded timing method in the words every screen uses (dtlab.config.placement.TIMING_METHODS),
        with the placement's account of where each collective's marks are taken when that is the method's."""

        m = self.timing_method
        words = TIMING_METHODS[m]
        if m == "wall_clock" and self.resolved.get("device_type") == "cuda":
            return f"{words}; on CUDA tensors these are the host's launch and wait times, not the GPU's"
        placed = self.resolved.get("placement", {}).get("timing")
        same = isinstance(placed, str) and placed.startswith("CUDA events") == (m == "cuda_events")
        if same and placed != words:  # the placement's account of where the marks go is this method's
            return f"{words}; {placed}"
        return words

    @property
    def measures_blocked(self) -> bool:
        """True for ZeRO-3 runs whose step events carry t_blocked (measured exposed communication)."""
        return self.spec.blocked_time and "t_blocked" in self.steps.columns and self.steps["t_blocked"].notna().any()

    def per_step(self) -> pd.DataFrame:
        """One row per measured step: t_step (slowest rank), t_comm (longest in-flight union across ranks),
        t_comp_est (estimated compute on the slowest rank), seconds. ZeRO-3 runs that measured blocked time
        add t_blocked (the slowest rank's time blocked on collectives) and t_comp_est = t_step - t_blocked."""
        return per_step(self)

    def comm_intervals(self) -> pd.DataFrame:
        """rank, step, t_start, t_end of every recorded collective (DDP buckets or ZeRO-3 collectives)."""
        return comm_intervals(self.buckets, self.collectives).dropna()

    def summary(self) -> pd.DataFrame:
        """Medians over measured steps of T_step, T_comp, T_comm, exposed communication and overlap, each with its
        90% interval, and how busy the machine was (dtlab.results.breakdown).

        Columns: quantity, value, unit, how (where the number comes from), lo and hi (the interval); a last row
        `machine` holds other processes' CPU (cores' worth) and the machine's state. An exposed time inside its
        noise has no value (NaN): its `how` says so, with the noise's size. See the module docstring for the
        definitions."""
        return summary(self)

    def bubble(self):
        """A pipeline run's measured bubble beside the (P-1)/(M+P-1) theory: `dtlab.results.pipeline.bubble`."""

        return bubble(self)

    def reference_check(self):
        """How a run with `reference` compares with its single-process copy: `dtlab.results.reference.check`."""

        return check(self)

    def to_chrome_trace(self, path: str | None = None):
        """The run as a Chrome / Perfetto trace (one process per rank; compute and communication tracks): the
        dict, or the path written when `path` is given. See `dtlab.results.chrome`."""

        return write_chrome_trace(self, path) if path else chrome_trace(self)

    def crosscheck(self) -> pd.DataFrame:
        """dtlab's communication timings against NCCL's and DDP's own timers: see `dtlab.results.crosscheck`."""

        return crosscheck(self)

    def whatif(self, link, **setting):
        """This DDP run's step predicted at another setting (bucket_mb MiB, nproc ranks per node, nodes,
        compression ratio) on `link` (a Profile, Link or TwoLevelLink), from everything the run measured: a
        `dtlab.results.whatif.WhatIf` with T_step, T_comp, T_comm and exposed (s), their band and the inputs used
        and not used. The same as `dtlab.whatif(run, link, ...)`."""

        return whatif(self, link, **setting)

    def breakdown_table(self, summary: pd.DataFrame | None = None) -> str:
        """The summary as aligned text, times in milliseconds, plus where model and data came from (`summary`:
        this run's `summary()` when the caller has it already)."""
        s = self.summary() if summary is None else summary
        lines = [
            f"run {self.path}",
            f"  {self.config.strategy} | {self.resolved.get('backend', '?')} | {self.nproc} ranks"
            + (f" on {self.resolved['nnodes']} nodes | " if self.resolved.get("nnodes", 1) > 1 else " | ")
            + (f"bucket {fmt_mib(self.config.ddp.bucket_mb)} MiB | " if self.spec.records == "buckets" else "")
            + f"batch {self.config.batch_size}/rank | "
            f"seq_len {self.config.seq_len} | status {self.status.get('state', '?')}",
            f"  ranks: {self.resolved.get('placement', {}).get('label', self.resolved.get('backend', '?'))}",
            f"  model: {self.resolved.get('model_source', '?')}",
            f"  data:  {self.resolved.get('data_source', '?')}",
        ]
        if isinstance(self.resolved.get("lr"), dict):
            lines.append(f"  lr:    {self.lr:g}, {self.resolved['lr'].get('source', '?')}")
        placed = self.resolved.get("placement", {})
        lines += [f"  note: {placed['note']}"] if placed.get("note") else []  # what the placement means
        lines.append(f"  timing: {self.timing_how}")  # how the figures were taken, as the ranks recorded it
        if self.resolved.get("oversubscribed"):
            lines.append(
                f"  note: {self.nproc} ranks on {self.resolved.get('cpu_cores')} CPU cores "
                "(oversubscribed: compute is slowed by sharing cores)"
            )
        lines += restart_lines(self) + status_lines(self) + convergence_lines(self)
        lines += summary_lines(s)
        return "\n".join(lines)


def load_run(path: str) -> Run:
    """Load a run directory (finished, failed or still running) into a `Run`, read strictly by dtlab.results.status:
    damage that can be skipped is a `RunDamageWarning` (also in `run.warnings`, line by line in `run.damage`);
    a config.json that cannot be read, or a missing events/ folder, is a `DamagedRun` naming the file.

    A run that has ended is read from its columnar copy when it has one that matches its lines
    (dtlab.results.columns); otherwise from the lines, a rank file at a time, and the copy is written then."""
    doc, version = read_doc(path)
    copy = read_copy(path) if os.path.isdir(os.path.join(path, "events")) else None
    if copy is not None:
        run = _from_copy(path, doc, version, copy)
    else:
        run, extras = _from_lines(path)
        if run.status.get("state") != "running":
            write_copy(path, {name: getattr(run, name) for name in COPIED}, extras, extras.pop("sources"))
    for w in run.warnings:
        warnings.warn(f"{path}: {w}", RunDamageWarning, stacklevel=2)
    return run


#: the Run attributes a columnar copy holds as frames
COPIED = ("steps", "baseline_steps", "buckets", "collectives", "memory", "ddp_stats", "blocked", "ranks", "damage")
COPIED += ("microbatches", "references", "evals", "updates", *FRAMES)
#: event kinds load_run keeps: their rows become frames a rank file at a time (FRAMED) or stay lists
FRAMED = ("step", "baseline_step", "bucket", "collective", "memory", "ddp_stats", "blocked", "start", "microbatch")
FRAMED += ("reference",)
LISTED = ("error", "checkpoint", "restart", "eval", "update", "machine")


class _Mixed(Exception):
    """A column whose type differs between rank files: the frame is built from every file's rows at once."""


def _from_lines(path: str, by_file: bool = True) -> tuple[Run, dict]:
    """(the Run read from the JSON lines, the rank files as read: file, bytes, lines, crc32). `by_file`: each rank
    file's rows become frames before the next file is read (what a long run needs to fit in memory); a column
    typed differently in two files reads the run again with every row kept until the end, as pandas types it."""
    parts: dict[str, list] = {k: [] for k in FRAMED}
    lists: dict[str, list] = {k: [] for k in (*LISTED, *FRAMES)}
    ddp_logging, sources, scanned = {}, [], [0]

    def take(rec, scan) -> None:
        rows: dict[str, list] = {k: [] for k in (*FRAMED, *LISTED)}
        for ev in scan.events:  # the scan's own dicts (let go once this returns), upgraded when of an earlier form
            ev = dict(upgrade_event(ev, rec.version)) if rec.version < CONFIG_VERSION else ev
            kind = ev.pop("kind", None)
            if kind in rows:
                rows[kind].append(ev)
            elif kind == "ddp_logging":
                ddp_logging[ev.get("rank")] = ev.get("data", {})
        # one timeline: what a restarted attempt redid is lost work (dtlab.results.restarts); a rank's own records
        # decide it, so a file at a time gives what every file at once gives
        rows, rows_rec = recovery(rows)
        for k in FRAMED:
            parts[k] += [pd.DataFrame(rows[k])] if by_file and rows[k] else rows[k]
        for k in LISTED:
            lists[k] += rows[k]
        for k in FRAMES:
            lists[k] += rows_rec[k]
        sources.append(
            {"file": os.path.basename(scan.path), "bytes": scan.nbytes, "lines": scan.lines, "crc32": scan.crc32}
        )
        scanned[0] = len(rec.warnings)  # the warnings about damaged lines come first, the state's after

    rec = read_run_dir(path, on_scan=take)
    try:
        built = {k: _concat(v) if by_file else pd.DataFrame(v) for k, v in parts.items()}
    except _Mixed:
        return _from_lines(path, by_file=False)
    mem = _frame(built["memory"], MEMORY_COLUMNS, sort=["rank"])
    if not mem.empty:  # the last memory record per rank is the final one (with the peak)
        mem = mem.groupby("rank", as_index=False).last()
    ranks = _frame(built["start"], RANK_COLUMNS, sort=["rank"]).drop_duplicates("rank", keep="last")  # restarts
    ranks["ended"] = ranks["rank"].map(rec.ended) if not ranks.empty else pd.Series(dtype=object)
    run = Run(
        path=path,
        config=recorded_config(rec.doc["config"], path),
        resolved=rec.doc.get("resolved", {}),
        status=rec.status,
        # `time`: the wall clock each rank stamped at a step's end (s since the epoch), one clock for the ranks of a
        # machine: with t_step it places the ranks' steps side by side (dtlab.model.prediction, the trace export)
        steps=_frame(built["step"], STEP_COLUMNS + ["time"]),
        baseline_steps=_frame(built["baseline_step"], STEP_COLUMNS + ["time"]),
        buckets=_frame(built["bucket"], BUCKET_COLUMNS, sort=["rank", "step", "t_ready"]),
        collectives=_frame(built["collective"], COLLECTIVE_COLUMNS, sort=["rank", "step", "t_start"]),
        memory=mem,
        errors=lists["error"],
        ddp_logging=ddp_logging,
        ddp_stats=_frame(built["ddp_stats"], ["rank", "step"]),
        blocked=_frame(built["blocked"], BLOCKED_COLUMNS, sort=["rank", "step", "t_start"]),
        ranks=ranks,
        warnings=list(rec.warnings),
        damage=_frame(pd.DataFrame(rec.damage()), DAMAGE_COLUMNS, sort=["file", "line"]),
        microbatches=_frame(built["microbatch"], MICROBATCH_COLUMNS, sort=["rank", "step", "t_start"]),
        references=_frame(built["reference"], REFERENCE_COLUMNS),
        evals=evals_frame(lists["eval"]),
        updates=updates_frame(lists["update"]),
        machine=lists["machine"],
        **{
            name: _frame(pd.DataFrame(lists[name]), cols, sort=[c for c in ("attempt", "step", "rank") if c in cols])
            for name, cols in FRAMES.items()
        },
    )
    extras = {
        "errors": run.errors,
        "ddp_logging": [[r, d] for r, d in ddp_logging.items()],
        "machine": run.machine,
        "scan_warnings": rec.warnings[: scanned[0]],
        "ended": [[r, e] for r, e in rec.ended.items()],
        "where": [[r, w] for r, w in rec.where.items()],
        "sources": sources,
    }
    return run, extras


def _concat(frames: list) -> pd.DataFrame:
    """The rank files' frames of one kind as one, the frame pandas makes of all their rows: so each column must
    have one type in every file that has it (a file without it gives NaN, as a row without the field does)."""
    if len(frames) <= 1:
        return frames[0] if frames else pd.DataFrame()
    types: dict = {}
    for df in frames:
        for c, t in df.dtypes.items():
            if types.setdefault(c, t) != t:
                raise _Mixed(c)
    return pd.concat(frames, ignore_index=True)


def _from_copy(path: str, doc: dict, version: int, copy: dict) -> Run:
    """The Run from its columnar copy: frames as they were built from the lines, the state read again."""
    ex = copy["extras"]
    rec = RunRecord(path, doc, {}, warnings=list(ex["scan_warnings"]), version=version)
    rec.ended, rec.where = dict(ex["ended"]), dict(ex["where"])
    settle_status(rec)
    return Run(
        path=path,
        config=recorded_config(doc["config"], path),
        resolved=doc.get("resolved", {}),
        status=rec.status,
        errors=ex["errors"],
        ddp_logging=dict(ex["ddp_logging"]),
        machine=ex["machine"],
        warnings=list(rec.warnings),
        **copy["frames"],
    )


def _frame(df: pd.DataFrame, columns: list[str], sort: list[str] | None = None) -> pd.DataFrame:
    if df.empty and not len(df.columns):  # no event of this kind (most frames of a run): made once, then copied
        key = (tuple(columns), repr(df.index))
        if key not in _EMPTY:
            _EMPTY[key] = _shaped(df, columns, sort)
        return _EMPTY[key].copy()
    return _shaped(df, columns, sort)


def _shaped(df: pd.DataFrame, columns: list[str], sort: list[str] | None) -> pd.DataFrame:
    missing = [c for c in columns if c not in df.columns]
    if missing:  # float columns of NaN, added at once (one by one cost a run's first load a tenth of its time)
        df = pd.concat([df, pd.DataFrame(np.nan, index=df.index, columns=missing)], axis=1)
    df = df[columns + [c for c in df.columns if c not in columns and c != "time"]]
    if not df.empty:
        df = df.sort_values(sort or ["rank", "step"], kind="stable").reset_index(drop=True)
    return df


_EMPTY: dict = {}  # _frame of a kind with no rows, by its columns


def recorded_config(doc: dict, path: str) -> RunConfig:
    """The `RunConfig` a run directory's config.json records (already brought to the current form by
    dtlab.results.upgrade); one that is not a RunConfig's fields is a `DamagedRun` naming config.json and why."""
    try:
        return RunConfig.from_dict(doc)
    except (TypeError, ValueError) as e:
        raise DamagedRun(os.path.join(path, "config.json"), f"its config is not a RunConfig: {e}") from None
