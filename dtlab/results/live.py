"""A run directory read while its ranks still write it: each rank's event file is followed from where the last read
stopped, so a poll costs only the bytes written since. Pure (no torch, no widgets, no processes): the notebook's
monitor (dtlab.viz.monitor) polls it; the numbers it shows come from dtlab.results.live_stats.

Each file is followed by dtlab.results.events.RankTail, the follower the strict reader (scan_events) reads
through too, so a torn or damaged line means the same here as in `load_run` once the run has ended: a line is
parsed only when its newline has arrived, a partial line left at `close()` is torn (tolerated, counted), a bad
line is torn only when a restarted attempt's `start` follows it, and any other is skipped and reported in
`damage`. A rank file that appears late (a rank still importing torch) is picked up by the first poll that finds
it.

`LiveRun(run_dir).poll()` reads every rank file's new lines and keeps the rows the monitor needs (steps, no-op
baseline steps, buckets, collectives, errors, `done`); `frames()` gives them as DataFrames. The rows each poll
brings become one small frame per kind (`chunks`), appended to what came before: a redraw of a long run builds
nothing again from the rows it has already seen (dtlab.results.live_stats keeps what it derived from them).
"""

from __future__ import annotations

import glob
import os

import pandas as pd

from dtlab.config.strategies import strategy_spec
from dtlab.results.events import RankTail, file_rank
from dtlab.results.run import recorded_config
from dtlab.results.upgrade import upgrade
from dtlab.runfiles import DamagedRun, read_json

#: the fields kept of each event kind the monitor shows (anything else a rank writes is read and passed over)
KEEP = {
    "step": ("rank", "step", "t_step", "t_fwd", "t_bwd", "t_opt", "loss", "compute_busy", "attempt", "time"),
    "baseline_step": ("rank", "step", "t_step", "paired_step", "attempt"),
    "bucket": ("rank", "step", "bucket", "nbytes", "wire_bytes", "t_start", "t_end", "attempt"),
    "collective": ("rank", "step", "op", "nbytes", "phase", "t_start", "t_end", "attempt"),
}


class LiveRun:
    """Every rank file of run directory `run_dir`, followed (see the module docstring).

    After each `poll()`: `chunks` (kind -> list of DataFrames, one per poll that brought rows of that kind, columns
    as in KEEP), `restarted` (True once a restarted attempt's `start` was read), `redone` (the kinds of which a
    rank recorded a step again, or out of order), `errors` ({rank: {error, step}}:
    the ranks that recorded an `error` event and the last step each recorded), `done` (ranks that recorded `done`),
    `last_step` ({rank: the last step it recorded}), and from config.json: `nproc` (the world size), `steps`,
    `warmup`, `baseline_steps`, `bucket_op` (the op that prices one DDP bucket; None when the strategy records
    collectives) and `launched` (the launch's wall time, s since the epoch; None when not recorded)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.tails: dict[str, RankTail] = {}
        self.chunks: dict[str, list[pd.DataFrame]] = {k: [] for k in KEEP}
        self._merged: dict[str, tuple[int, pd.DataFrame]] = {}  # kind -> (chunks merged, their frame)
        self._top: dict[tuple[str, int], int] = {}  # (kind, rank) -> the highest step read
        self.restarted = False
        self.redone: set[str] = set()
        self.view_cache = None  # what dtlab.results.live_stats.live_view keeps between redraws
        self.errors: dict[int, dict] = {}
        self.done: set[int] = set()
        self.last_step: dict[int, int] = {}
        self.polls = 0
        self._config()

    def _config(self) -> None:
        """The run's config, read as every reader reads it (upgraded to today's form, then a RunConfig); nothing
        is known of it while config.json is missing or unreadable."""
        self.launched = None  # wall time (s since the epoch) the launcher started the run, from config.json
        try:
            doc = read_json(os.path.join(self.run_dir, "config.json"))
            self.launched = (doc.get("launch") or {}).get("time")
            cfg = recorded_config(upgrade(doc["config"]), self.run_dir)
            bucket_op = strategy_spec(cfg.strategy).bucket_op
        except (OSError, DamagedRun, KeyError, TypeError, ValueError):  # a strategy this dtlab does not know too
            cfg, bucket_op = None, None
        self.nproc = cfg.nproc * cfg.nnodes if cfg is not None and cfg.nproc else None
        self.steps = cfg.steps if cfg is not None else None
        self.warmup = cfg.warmup if cfg is not None else 0
        self.baseline_steps = int(cfg.measurement.baseline_steps or 0) if cfg is not None else 0
        self.bucket_op = bucket_op

    def poll(self) -> int:
        """Read every rank file's new complete lines (a file that appeared since is followed from now on);
        returns how many events were new."""
        for path in sorted(glob.glob(os.path.join(self.run_dir, "events", "rank*.jsonl"))):
            if path not in self.tails and file_rank(path) is not None:
                self.tails[path] = RankTail(path)
        self.polls += 1
        return sum(self._take(tail.read()) for tail in self.tails.values())

    def close(self) -> int:
        """The run has ended: read the rest of every file, partial last lines counted as torn."""
        self.poll()
        return sum(self._take(tail.close()) for tail in self.tails.values())

    def _take(self, events: list[dict]) -> int:
        rows: dict[str, list] = {k: [] for k in KEEP}
        for ev in events:
            kind, rank = ev["kind"], ev.get("rank")
            if kind in KEEP:
                rows[kind].append(tuple(ev.get(k) for k in KEEP[kind]))
                if kind in ("step", "baseline_step"):
                    top = self._top.get((kind, rank))
                    if top is not None and not ev["step"] > top:
                        self.redone.add(kind)  # frames() keeps the last record of a (rank, step)
                    self._top[(kind, rank)] = ev["step"] if top is None else max(top, ev["step"])
            if kind == "step":
                self.last_step[rank] = ev["step"]
            elif kind == "error":
                self.errors[rank] = {"error": ev["error"], "step": self.last_step.get(rank)}
            elif kind == "done":
                self.done.add(rank)
            elif kind == "start" and int(ev.get("attempt") or 0) > 0:  # torchrun restarted the group
                self.errors.pop(rank, None)
                self.done.discard(rank)
                self.restarted = True
        for kind, got in rows.items():
            if got:
                self.chunks[kind].append(pd.DataFrame.from_records(got, columns=list(KEEP[kind])))
        return len(events)

    @property
    def torn(self) -> int:
        """Torn lines tolerated so far, over every rank file."""
        return sum(len(t.torn) for t in self.tails.values())

    @property
    def damage(self) -> list[dict]:
        """Every skipped line so far: file, line, what."""
        return [d for t in self.tails.values() for d in t.damage]

    def frames(self) -> dict[str, pd.DataFrame]:
        """{kind: DataFrame} of the rows kept so far (columns as in KEEP, minus `attempt`); a step redone after a
        restart keeps its last record."""
        return {kind: self.frame(kind) for kind in KEEP}

    def frame(self, kind: str) -> pd.DataFrame:
        """One kind's rows so far as `frames()` gives them: the chunks not merged yet are appended to the frame
        merged at the last call."""
        done, df = self._merged.get(kind, (0, None))
        new = self.chunks[kind][done:]
        if new or df is None:
            df = append_rows([df, *new] if df is not None else new, list(KEEP[kind]))
            self._merged[kind] = (len(self.chunks[kind]), df)
        if kind in self.redone and not df.empty:
            df = df.drop_duplicates(["rank", "step"], keep="last")
        return df.drop(columns="attempt").reset_index(drop=True)


def append_rows(frames: list, columns: list[str]) -> pd.DataFrame:
    """The frames (pieces of one kind's rows, in order) as one, each column typed as pandas types the rows read
    all at once: a column typed alike in every piece is joined as it is, any other is typed again from its
    values (a field null in one piece and a number in the next is a float column with NaN, as in one frame)."""
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame(columns=columns)
    if len(frames) == 1:
        return frames[0]
    out = pd.concat(frames, ignore_index=True)
    for c in columns:
        if len({str(f[c].dtype) for f in frames}) > 1:
            out[c] = pd.Series([v for f in frames for v in f[c].tolist()], dtype=None)
    return out
