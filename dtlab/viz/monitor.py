"""The live monitor: what a run is doing while its ranks run, drawn in the notebook (or printed as a text line
outside one) from the event files the ranks are already writing (docs/monitor.md).

- `monitor_figure(view)`: the figure (pure: a view of dtlab.results.live_stats.live_view in, a Figure out).
- `Monitor`: follows a run directory (dtlab.results.live.LiveRun: each file read from where the last read
  stopped), redraws every `every_s` seconds while new lines arrive, and ends with the failure (the rank named) or
  the final breakdown (`Run.breakdown_table()`, from `run.summary()`).
- `watch(handle)`: waits on a launched job with a Monitor (Handle.wait's `on_poll`): how `dtlab.run(cfg,
  watch=True)` (dtlab.course.watching) watches. A rank failure, a stall or a kernel interrupt stops the job as
  `Handle.wait` does; the monitor shows where it stopped, then RunFailed or KeyboardInterrupt is raised as before.

The monitor runs in the notebook's process and only reads files the ranks write anyway: the ranks do no extra
work for it. In JupyterLab the figure is a LiveFigure (plotly's JSON in an Output widget, shown again whole on
every redraw: dtlab.viz.dashboard). A view carries no number the events do not: a panel whose source is absent
(the compute stream's busy fraction, which no strategy records today) is left out. The GPU panel is the one panel
not read from the events: at each redraw the monitor asks NVML (dtlab.config.nvml, the source of the machine's GPU
state) for each GPU's utilisation and memory; without a driver it is left out.
"""

from __future__ import annotations

import html
import sys
import time

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from IPython import get_ipython
from IPython.display import display
from plotly.subplots import make_subplots

from dtlab.config.nvml import gpu_state
from dtlab.results.live import LiveRun
from dtlab.results.live_stats import live_view, text_line
from dtlab.results.status import RunFailed
from dtlab.units import fmt_gbps, fmt_ms
from dtlab.viz.figures import COLORS, wrap_title
from dtlab.viz.livefigure import LiveFigure

MODES = ("auto", "widget", "text")
EVERY_S = 2.0  # seconds between redraws (and text lines) while new events arrive
#: a redraw waits at least this many times its own CPU cost after the last one: a long run, whose redraws grow with
#: its steps, never takes more than 1 / BUDGET (5 %) of a core from the notebook (and from ranks that share it)
BUDGET = 20
#: a per-step line longer than this many steps is drawn thinned: each bin of consecutive steps by its smallest and
#: largest value, in step order (a spike survives; every step of every line of a 100,000-step run is slow to draw)
MAX_POINTS = 4000
RANK_COLORS = (
    "#4C78A8",
    "#54A24B",
    "#B279A2",
    "#9D755D",
    "#72B7B2",
    "#FF9DA6",
    "#EECA3B",
    "#BAB0AC",
)  # no T_comm orange


def in_notebook() -> bool:
    """True inside a Jupyter kernel (widgets can be displayed), False in a terminal or a plain script."""
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def monitor_title(view: dict) -> str:
    """'dtlab monitor: running, 12 steps of 300 (2 ranks); straggler: rank 1 (+27.7 ms)'."""
    done = f"{view['step'] + 1} steps" if view["step"] >= 0 else "no complete step yet"
    text = f"dtlab monitor: {view['state']}, {done}" + (f" of {view['steps']}" if view.get("steps") else "")
    text += f" ({view['nproc']} ranks)" if view.get("nproc") else ""
    s = view["straggler"]
    text += f"; straggler: rank {s['rank']} (+{fmt_ms(s['gap_s'])} own time)" if s else ""
    return text


def monitor_figure(view: dict) -> go.Figure:
    """Loss, T_step per step (slowest rank, each rank's own time, T_comm, exposed where paired), the communication
    share, and the bus bandwidth per bucket or collective against its calibration; each GPU's utilisation and
    memory over the run's seconds when NVML was read (view['gpus']), and the compute stream's busy share when the
    events carry it. Milliseconds, percent, GiB and GB/s on the axes."""
    t = view["table"]
    busy = not t.empty and t["compute_busy"].notna().any()
    gpus = view.get("gpus")
    gpus = gpus if gpus is not None and not gpus.empty else None
    rows = 3 if busy or gpus is not None else 2
    titles = ["loss (mean over ranks)", "step time (ms)", "communication share of T_step (%)", _bw_title(view)]
    if rows == 3:
        titles += ["GPU utilisation (%, NVML)" if gpus is not None else "compute stream busy (%)"]
        titles += ["GPU memory used (GiB, NVML)"] if gpus is not None else []
    fig = make_subplots(rows=rows, cols=2, subplot_titles=titles)
    x = t["step"].to_numpy()  # arrays, not lists: plotly checks a list value by value (seconds at 100,000 steps)
    fig.add_trace(_line(x, t["loss"], "loss", None), 1, 1)
    fig.add_trace(_line(x, t["t_step"] * 1e3, "T_step (slowest rank)", "#222222"), 1, 2)
    for i, (rank, g) in enumerate(view["ranks"].groupby("rank")):
        color = RANK_COLORS[i % len(RANK_COLORS)]
        fig.add_trace(_line(g["step"].to_numpy(), g["own_s"] * 1e3, f"rank {rank} own time", color, "dot"), 1, 2)
    if t["t_comm"].notna().any():
        fig.add_trace(_line(x, t["t_comm"] * 1e3, "T_comm", COLORS["T_comm"]), 1, 2)
        fig.add_trace(_line(x, t["comm_share"] * 100, "T_comm / T_step", COLORS["T_comm"]), 2, 1)
    p = view["pairs"]
    if not p.empty:
        marker = dict(color=COLORS["exposed"], symbol="x", size=9)
        fig.add_trace(go.Scatter(x=p["step"].tolist(), y=(p["exposed"] * 1e3).tolist(), name="exposed (paired)",
                                 mode="markers", marker=marker), 1, 2)  # fmt: skip
    _bandwidth(fig, view["bw_table"])
    if gpus is not None:
        _gpu_panels(fig, gpus)
    elif busy:
        fig.add_trace(_line(x, t["compute_busy"] * 100, "compute stream busy", COLORS["T_comp"]), 3, 1)
        fig.update_yaxes(title_text="%", row=3, col=1)
    for r, c, unit in ((1, 1, "loss"), (1, 2, "ms"), (2, 1, "%"), (2, 2, "GB/s")):
        fig.update_yaxes(title_text=unit, row=r, col=c, rangemode="tozero" if unit != "loss" else "normal")
    fig.update_xaxes(title_text="step", row=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(
        title=wrap_title(monitor_title(view), 110),
        height=360 * rows + 80,
        margin=dict(t=90, b=110),
        legend=dict(orientation="h", yanchor="top", y=-0.1, x=0),
    )
    return fig


def _gpu_panels(fig: go.Figure, gpus: pd.DataFrame) -> None:
    for i, (index, g) in enumerate(gpus.groupby("index")):
        color = RANK_COLORS[i % len(RANK_COLORS)]
        t_s = g["t_s"].to_numpy()
        fig.add_trace(_line(t_s, g["util_pct"], f"GPU {index} utilisation", color, per="samples"), 3, 1)
        fig.add_trace(_line(t_s, g["memory_used_bytes"] / 2**30, f"GPU {index} memory", color, per="samples"), 3, 2)
    fig.update_yaxes(title_text="%", rangemode="tozero", row=3, col=1)
    fig.update_yaxes(title_text="GiB", rangemode="tozero", row=3, col=2)
    fig.update_xaxes(title_text="s since the monitor started", row=3)


def gpu_samples(samples: list, state: list | None, t_s: float) -> None:
    """Append each GPU of `state` (dtlab.config.nvml.gpu_state) to `samples` as a row at `t_s` seconds."""
    for g in state or []:
        samples.append({"t_s": t_s, **{k: g[k] for k in ("index", "util_pct", "memory_used_bytes")}})


def _line(x, y, name: str, color: str | None, dash: str = "solid", per: str = "steps") -> go.Scatter:
    """One line over steps (or NVML's `per`="samples"); over MAX_POINTS of them thinned (`thin`), drawn without
    markers, its name saying so."""
    x, y, k = thin(np.asarray(x), _values(y))
    how = f"min and max of each {k} {per}"
    thinned = f"{name[:-1]}; {how})" if name.endswith(")") else f"{name} ({how})"  # one pair of brackets
    name, mode = (thinned, "lines") if k > 1 else (name, "lines+markers")
    return go.Scatter(x=x, y=y, name=name, mode=mode, line=dict(color=color, dash=dash))


def thin(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray, int]:
    """(x, y, k): the points as given (k = 1) when there are at most `max_points`, else each bin of k consecutive
    points (k the smallest that makes at most max_points / 2 bins) drawn by its smallest and its largest y, in the
    order they came; a bin without a value is one NaN point (a gap in the line, as a missing value is)."""
    n = len(x)
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2 (a bin's min and max), got {max_points!r}")
    if n <= max_points:
        return x, y, 1
    k = -(-n // (max_points // 2))
    bins = -(-n // k)
    pad = bins * k - n
    yb = np.concatenate([y, np.full(pad, np.nan)]).reshape(bins, k)
    xb = np.concatenate([x.astype(float), np.full(pad, np.nan)]).reshape(bins, k)
    lo = np.where(np.isnan(yb), np.inf, yb).argmin(axis=1)
    hi = np.where(np.isnan(yb), -np.inf, yb).argmax(axis=1)
    first, second = np.minimum(lo, hi), np.maximum(lo, hi)
    rows = np.arange(bins)
    xs = np.stack([xb[rows, first], xb[rows, second]], axis=1)
    ys = np.stack([yb[rows, first], yb[rows, second]], axis=1)  # an empty bin: NaN at its first step
    same = first == second  # one point in the bin (or one value): drawn once
    keep = np.stack([np.ones(bins, bool), ~same], axis=1)
    return xs[keep], ys[keep], k


def _values(y) -> np.ndarray:
    """A column as floats (a missing value is NaN: a gap in the line, as None was)."""
    return pd.to_numeric(pd.Series(y), errors="coerce").to_numpy(dtype=float)


def _bw_title(view: dict) -> str:
    return "bus bandwidth (GB/s): " + ("no calibration" if "no calibration" in view["calibration"] else "vs calibrated")


def _bandwidth(fig: go.Figure, table: pd.DataFrame) -> None:
    if table.empty:
        return
    labels = table["what"].tolist()
    fig.add_trace(go.Bar(x=labels, y=(table["busbw"] / 1e9).tolist(), name="busbw (median)",
                         marker_color=COLORS["bucket"], text=[fmt_gbps(v) for v in table["busbw"]]), 2, 2)  # fmt: skip
    cal = table["calibrated"]
    if cal.notna().any():
        fig.add_trace(go.Scatter(x=labels, y=(cal / 1e9).tolist(), name="calibrated (1/beta)", mode="markers",
                                 marker=dict(symbol="line-ew-open", size=30, color="#222222")), 2, 2)  # fmt: skip


def monitor_notes(view: dict) -> list[str]:
    """What the figure cannot say with a number: how the run ended, errors the ranks recorded, what is not
    available (exposed time before a no-op step is paired, T_comm a run does not record), the calibration, and
    torn or damaged event lines."""
    out = [f"{view['state']}: {view['why']}"] if view["state"] != "running" and view.get("why") else []
    out.append(f"bus bandwidth: {view['calibration']}")
    if view["pairs"].empty and view.get("unpaired"):
        out.append("exposed: the no-op baseline steps carry no pairing (an earlier dtlab): see the final breakdown")
    elif view["pairs"].empty and view.get("baseline_steps"):
        out.append("exposed: not available until a no-op baseline step is paired with a training step")
    elif view["pairs"].empty:
        out.append("exposed: not available live (no no-op baseline steps: the final breakdown says how it is measured)")
    if view["table"].empty or view["table"]["t_comm"].isna().all():
        out.append("T_comm: not recorded by this run's events so far")
    for rank, e in sorted(view["errors"].items()):
        out.append(f"rank {rank} recorded an error after step {e['step']}: {str(e['error'])[:160]}")
    if view["torn"] or view["damaged"]:
        out.append(f"event lines: {view['torn']} torn (tolerated), {view['damaged']} damaged (skipped)")
    return out


class Monitor:
    """Follows the run directory `run_dir` (see the module docstring). `profile`: a Profile whose fits give the
    calibrated bus bandwidth (None: "no calibration"). `mode`: 'auto' (widgets in a Jupyter kernel, text
    elsewhere), 'widget' or 'text'. `every_s`: seconds between redraws (> 0). `out`: where text lines go.

    `poll()` reads what the ranks wrote since the last read and redraws when `every_s` has passed (longer when a
    redraw is costly: BUDGET);
    `finish(state, why, run)` reads the rest, draws the end state and, for a finished run, its breakdown.
    `view` is the last view drawn; `redraws` counts them; `widget` is the VBox shown (widget mode)."""

    def __init__(self, run_dir: str, profile=None, mode: str = "auto", every_s: float = EVERY_S, out=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        if not isinstance(every_s, (int, float)) or not every_s > 0:
            raise ValueError(f"every_s must be a number of seconds > 0, got {every_s!r}")
        if profile is not None and not hasattr(profile, "fits"):
            raise ValueError(
                f"profile must be a dtlab Profile (dtlab.calibrate or dtlab.load_profile), got {profile!r}"
            )
        self.live, self.profile, self.every_s = LiveRun(run_dir), profile, float(every_s)
        self.mode = ("widget" if in_notebook() else "text") if mode == "auto" else mode
        self.out = out or sys.stdout
        self.view: dict | None = None
        self.redraws, self._last, self.wait_s = 0, -float("inf"), self.every_s
        self.widget = None
        self.watching = True  # a run watched as it runs: elapsed time on this clock (False: a record shown after)
        self.gpus: list[dict] = []  # NVML's samples, one row per GPU per redraw (the GPU panel)
        self._t0 = time.monotonic()
        if self.mode == "widget":
            self._status = widgets.HTML(value="<b>dtlab monitor</b>: waiting for the ranks' first events")
            self._figure = LiveFigure(go.Figure(layout=dict(title="dtlab monitor: starting", height=300)))
            self._end = widgets.HTML(value="")
            self.widget = widgets.VBox([self._status, self._figure, self._end])
            self.widget.add_class("dtlab-monitor")
            display(self.widget)

    def poll(self) -> None:
        """Read the new lines and redraw if something came and the wait is over: `every_s`, or BUDGET times the
        CPU time the last redraw took, whichever is longer (`wait_s`)."""
        now = time.monotonic()
        if now - self._last < self.wait_s:
            return
        cpu = time.process_time()
        if self.live.poll() or self.view is None:
            self._draw(live_view(self.live, self.profile, now=time.time()))
        self.wait_s = max(self.every_s, BUDGET * (time.process_time() - cpu))
        self._last = now

    def finish(self, state: str, why: str = "", run=None) -> None:
        """The run ended in `state` ('finished', 'failed', 'interrupted', ...) for reason `why`: read the rest
        (partial last lines counted as torn), draw the end state, and for a finished `run` show its breakdown."""
        self.live.close()
        self._draw(live_view(self.live, self.profile, state, why, time.time() if self.watching else None))
        table = run.breakdown_table() if run is not None else ""
        if self.mode == "text":
            print(table, file=self.out, flush=True) if table else None
        elif table:
            self._end.value = f"<pre class='dtlab-monitor-breakdown'>{html.escape(table)}</pre>"

    def _draw(self, view: dict) -> None:
        if self.mode == "widget":
            gpu_samples(self.gpus, gpu_state(), time.monotonic() - self._t0)
            view = {**view, "gpus": pd.DataFrame(self.gpus)}
        self.view, self.redraws = view, self.redraws + 1
        if self.mode == "text":
            print(text_line(view), file=self.out, flush=True)
            return
        self._figure.show(monitor_figure(view))
        line = text_line({**view, "state": "running"}).removeprefix("dtlab watch: ")  # the state is said first
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in monitor_notes(view))
        self._status.value = (
            f"<div class='dtlab-monitor-status' data-state='{html.escape(view['state'])}'><b>dtlab monitor</b> "
            f"({view['state']}, redraw {self.redraws}): {html.escape(line)}</div>"
            f"<ul class='dtlab-monitor-notes'>{notes}</ul>"
        )


def failure_words(e: RunFailed) -> str:
    """'rank 1 (SIGKILL): <its error>; rank 0 failed as a consequence': who caused a failed run and how, from the
    RunFailed the launcher raised."""
    who = f"rank {e.rank}" if e.rank is not None else "no rank could be named"
    how = f" ({e.signal})" if e.signal else ""
    first = (str(e).strip().splitlines() or [""])[0]
    then = [c["rank"] for c in e.consequences if c.get("rank") is not None]
    after = f"; rank {', '.join(map(str, then))} failed as a consequence" if then else ""
    return f"{who}{how}: {(e.error or first)[:300]}{after}"


def watch(handle, profile=None, mode: str = "auto", every_s: float = EVERY_S):
    """Wait on `handle` (dtlab.launch's Handle) with a `Monitor`; returns the loaded Run. On a failure the monitor
    names the culprit rank, then RunFailed is raised; on KeyboardInterrupt (a kernel interrupt) the job is
    stopped, the monitor says where, and the interrupt is raised again."""
    mon = Monitor(handle.run_dir, profile, mode, every_s)
    try:
        run = handle.wait(progress=False, on_poll=mon.poll)
    except RunFailed as e:
        mon.finish(e.state or "failed", failure_words(e))
        raise
    except KeyboardInterrupt:
        mon.finish("interrupted", "stopped by a keyboard (kernel) interrupt; every rank was stopped")
        raise
    mon.finish("finished", run=run)
    return run
