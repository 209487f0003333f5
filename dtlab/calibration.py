"""Collective sweeps that calibrate alpha and beta on this machine.

`calibrate(nproc=2, ops=("all_reduce",), sizes=...)` launches ranks through the same launcher as training
runs. Each rank makes `rounds` passes over all (op, size) pairs in a freshly shuffled order; in each pass a
size gets `warmup` untimed calls and then a block of timed ones (`iters` per size in all), so every size is
timed in its steady state and drift in the machine's load is shared by all sizes. Every timed iteration
is aligned across ranks first and ends when the collective has completed on this rank:

- gloo: a host barrier (not timed), then the wall clock around one blocking call;
- CUDA (NCCL, or gloo on CUDA tensors): a host barrier cannot align GPUs: ranks would enqueue at different host
  times and the skew (tens of microseconds, the size of NVLink's alpha) would land in alpha. Instead a tiny
  all-reduce is enqueued right before the start event, so the event fires only once every rank's device has
  reached that point, and `batch` (K) back-to-back calls sit between the two events, as nccl-tests times
  them; the sample is the elapsed time / K (synchronised once per sample: here the collective is what is
  measured). The slowest rank per iteration is
the sample that goes into the fit. The result is a machine profile (`profile.json`): host, devices,
backend, versions, the raw samples, and the alpha-beta fit per op.

The ranks run dtlab.rank.calibration (`torchrun ... -m dtlab.rank.calibration RUN_DIR`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass

# "ps": a parameter-server round, dist.reduce to rank 0 then dist.broadcast from it (dtlab.rank.ps, one bucket)
OPS = ("all_reduce", "reduce_scatter", "all_gather", "ps")
# Powers of 2 from 4 KiB to 64 MiB: 15 sizes spanning the latency- and bandwidth-bound regimes, dense
# enough that each protocol regime gets several points (see dtlab.model.fit.fit_piecewise).
DEFAULT_SIZES = tuple(2 ** k for k in range(12, 27))


@dataclass(kw_only=True)
class CalibConfig:
    """What to measure. Sizes are full message bytes (nccl-tests convention), rounded up to a multiple of
    4 x lcm(nproc, group_sizes) so every rank's share is a whole number of fp32 elements."""

    nproc: int = 2
    """Ranks per node (nproc x nnodes at least 2: a collective needs peers); placed like a run's (dtlab.placement)."""
    ops: tuple = ("all_reduce",)
    """Collectives to time: all_reduce, reduce_scatter, all_gather, ps (reduce to rank 0 + broadcast)."""
    sizes: tuple = DEFAULT_SIZES
    """Full message sizes in bytes."""
    warmup: int = 3
    """Untimed iterations before each timed block of a size."""
    iters: int = 12
    """Timed samples per size, spread over the rounds."""
    batch: int | None = None
    """Back-to-back calls per timed sample (K); the sample is their mean. None: 20 on CUDA, 1 on gloo-CPU
    (where one call is milliseconds and each sample keeps its own barrier)."""
    rounds: int = 3
    """Passes over all sizes, each in a freshly shuffled order (1 = one block per size, as nccl-tests)."""
    backend: str = "auto"
    """'auto', 'nccl' or 'gloo', resolved like a run's backend."""
    form: str = "ring"
    """Which alpha-beta form the profile fits: 'ring' or 'textbook' (see dtlab.model.costmodel)."""
    fit_min_bytes: int | None = None
    """Fit only sizes >= this (collectives switch protocol between small and large messages)."""
    fit_max_bytes: int | None = None
    """Fit only sizes <= this."""
    out: str | None = None
    """Profile directory; default profiles/calib-p<nproc>-<timestamp>."""
    timeout_s: float = 1800.0
    """Wall-clock limit for the whole sweep in seconds; past it every rank is stopped."""
    nnodes: int = 1
    """Nodes in the sweep, nproc ranks on each (one rank per node times the inter-node link); see dtlab.multinode."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous, the same on every node (needed when nnodes > 1)."""
    rdzv_id: str | None = None
    """Job id that every node of one sweep gives (None: derived from `out`)."""
    rdzv_timeout_s: float = 600.0
    """Seconds to wait for all nnodes nodes to join; past it the sweep fails naming the missing ones."""
    group_sizes: tuple | None = None
    """Also time every op on the first k ranks, for each k here (e.g. 2,3,4 with nproc 4; the other ranks wait at
    the barrier), so several p are measured in one launch, interleaved under the same load. None: nproc only."""

    def __post_init__(self) -> None:
        if isinstance(self.ops, str):
            self.ops = tuple(o.strip() for o in self.ops.split(",") if o.strip())
        self.ops, self.sizes = tuple(self.ops), tuple(self.sizes)
        if isinstance(self.group_sizes, str):  # the CLI's "2,3,4"
            self.group_sizes = tuple(int(k) if k.strip().isdigit() else k for k in self.group_sizes.split(","))
        if self.group_sizes is not None:
            self.group_sizes = tuple(self.group_sizes)

    def validate(self, cuda_device_count: int | None = None) -> "CalibConfig":
        """Refuse bad fields by name, before anything starts."""
        from dtlab.config import BACKENDS, RunConfig, _choice, _int_at_least
        _int_at_least("nproc", self.nproc, 1)
        if isinstance(self.nnodes, int) and self.nproc * self.nnodes < 2:
            raise ValueError(f"nproc x nnodes must be >= 2 (a collective needs peers), got nproc={self.nproc}, "
                             f"nnodes={self.nnodes}; one GPU hosts 2 ranks (dtlab.placement), so use nproc=2 "
                             "(dtlab.labs.calibration_ranks(cfg) gives a run's ranks, at least 2)")
        if not self.ops or any(o not in OPS for o in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {', '.join(OPS)}, got {list(self.ops)!r}")
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 for s in self.sizes):
            raise ValueError(f"sizes must be a non-empty list of integers >= 4 (bytes), got {list(self.sizes)!r}")
        _int_at_least("warmup", self.warmup, 0)
        _int_at_least("iters", self.iters, 1)
        _int_at_least("rounds", self.rounds, 1)
        if self.batch is not None:
            _int_at_least("batch", self.batch, 1)
        if self.group_sizes is not None and (not self.group_sizes or any(
                isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= self.nproc * self.nnodes
                for k in self.group_sizes)):
            raise ValueError(f"group_sizes must be integers between 2 and nproc x nnodes "
                             f"({self.nproc * self.nnodes}), got {list(self.group_sizes)!r}")
        if self.rounds > self.iters:
            raise ValueError(f"rounds must be <= iters ({self.iters}) so every round times each size, got {self.rounds}")
        _choice("backend", self.backend, BACKENDS)
        _choice("form", self.form, ("ring", "textbook"))
        for name in ("fit_min_bytes", "fit_max_bytes"):
            if getattr(self, name) is not None:
                _int_at_least(name, getattr(self, name), 0)
        from dtlab.config import _finite
        _finite("timeout_s", self.timeout_s, "(seconds)", low=0.0)
        # The machine checks (nccl needs CUDA, one GPU per rank) are the training runs' own.
        RunConfig(nproc=self.nproc, backend=self.backend).validate(cuda_device_count)
        from dtlab.multinode import validate_nodes
        validate_nodes(self)
        return self

    def resolved_backend(self) -> str:
        from dtlab.config import RunConfig
        return RunConfig(nproc=self.nproc, backend=self.backend).resolved_backend()

    def ranks_timed(self) -> list[int]:
        """The group sizes p timed: group_sizes (ascending, deduplicated), else every rank: [nproc x nnodes]."""
        return sorted(set(self.group_sizes)) if self.group_sizes else [self.nproc * self.nnodes]

    def rounded_sizes(self) -> list[int]:
        import math
        unit = 4 * math.lcm(self.nproc * self.nnodes, *self.ranks_timed())
        return sorted({-(-s // unit) * unit for s in self.sizes})


def calibrate(nproc: int = 2, ops=("all_reduce",), sizes=DEFAULT_SIZES, *, warmup: int = 3, iters: int = 12,
              rounds: int = 3, backend: str = "auto", form: str = "ring", fit_min_bytes: int | None = None,
              fit_max_bytes: int | None = None, out: str | None = None, timeout_s: float = 1800.0,
              batch: int | None = None, group_sizes=None, progress: bool = True):
    """Measure the collectives, fit alpha and beta, save and return the machine `Profile` (see dtlab.model.profile).

    sizes are full message bytes; `batch` calls are timed back to back per sample (default: 20 on CUDA, 1 on
    gloo-CPU); `group_sizes` (e.g. (2, 3, 4) with nproc=4) also times the first k ranks for each k, interleaved
    in the same launch; the fit can be limited to [fit_min_bytes, fit_max_bytes]; the profile is
    written to OUT/profile.json and read back with `dtlab.load_profile(OUT)`."""
    return launch_calibration(CalibConfig(nproc=nproc, ops=ops, sizes=tuple(sizes), warmup=warmup, iters=iters,
                                          rounds=min(rounds, iters), backend=backend, form=form, fit_min_bytes=fit_min_bytes,
                                          fit_max_bytes=fit_max_bytes, out=out, timeout_s=timeout_s,
                                          batch=batch, group_sizes=group_sizes)).wait(progress=progress)


def launch_calibration(cfg: CalibConfig, spec=None):
    """Start a calibration sweep (this node's part of it when nnodes > 1; `spec`: a dtlab.launching.nodes.NodeSpec,
    see dtlab.emulate); returns a launcher Handle whose wait() gives the Profile."""
    from dtlab.launcher import Handle, unique_dir
    from dtlab.launching.handle import launch_facts
    from dtlab.launching.nodes import start_job

    from dtlab.course import replay
    if replay.replay_root():  # grading a submission: its recorded sweep, not a new one
        fields, defaults = dataclasses.asdict(cfg), dataclasses.asdict(type(cfg)())
        return replay.Replayed(replay.require("calibration", fields, defaults), load_calibration)
    cfg.validate()
    out = os.path.abspath(cfg.out) if cfg.nnodes > 1 else (cfg.out or unique_dir("profiles", f"calib-p{cfg.nproc}"))
    cfg = dataclasses.replace(cfg, out=out)
    backend = cfg.resolved_backend()
    node, proc = start_job(cfg, "calibration", dataclasses.asdict(cfg), {"time": time.time(), "backend": backend,
                                                                         **launch_facts()},
                           "dtlab.rank.calibration", backend == "gloo", spec)
    total = cfg.rounds  # progress counts rounds; each round times every (op, size)
    where = f" x{cfg.nnodes} nodes" if cfg.nnodes > 1 else ""
    return Handle(node.run_dir, proc, cfg.nproc, total, cfg.timeout_s,
                  f"calibrate {','.join(cfg.ops)} x{cfg.nproc}{where} ({backend})", loader=load_calibration,
                  unit="round", node=node)


def samples_frame(run_dir: str):
    """The raw samples of a calibration directory: one row per rank and timed iteration, plus the slowest
    rank per iteration as `seconds` (columns op, nbytes, nproc, iter, seconds, rank_spread)."""
    import glob

    import pandas as pd

    from dtlab.results import read_events
    rows = [e for p in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.jsonl")))
            for e in read_events(p) if e.get("kind") == "sample"]
    raw = pd.DataFrame(rows, columns=["rank", "op", "nbytes", "nproc", "iter", "seconds"])
    if raw.empty:
        return raw, raw
    g = raw.groupby(["op", "nbytes", "nproc", "iter"])["seconds"]
    slow = g.max().rename("seconds").to_frame()
    slow["rank_spread"] = g.max() - g.min()
    return raw, slow.reset_index()


def load_calibration(run_dir: str, partial: bool = False):
    """Fit (or re-fit) the samples of a calibration directory, write profile.json, return the Profile.

    Raises RunFailed (its `state` says how the sweep ended: interrupted, stopped, failed, abandoned, ...; its
    `run`: the samples recorded) when the sweep did not finish, unless `partial`: then what was recorded is
    fitted, and the profile says in its caveats and meta['partial'] that the sweep did not finish."""
    import warnings

    from dtlab.model.profile import Profile
    from dtlab.rundir import RunDamageWarning, RunFailed, read_run_dir, require_finished, sweep_progress

    rec = read_run_dir(run_dir, key="calibration")
    for w in rec.warnings:
        warnings.warn(f"{run_dir}: {w}", RunDamageWarning, stacklevel=2)
    doc, cal = rec.doc, rec.doc["calibration"]
    raw, samples = samples_frame(run_dir)
    recorded = sweep_progress(rec)
    try:
        require_finished(rec, "the calibration", run=samples,
                         hint=f"{recorded}; no profile was written. dtlab.calibration.load_calibration(path, "
                              "partial=True) fits what was recorded, labelled as partial.")
        unfinished = None
    except RunFailed as e:
        if not partial or raw.empty:
            raise
        unfinished = f"partial: the sweep {e.state} before it finished ({recorded}); fitted from those samples only"
    meta = {**doc.get("resolved", {}), "calibration": cal, "rank_samples": len(raw),
            "timing": doc.get("resolved", {}).get("timing",
                                                   "slowest rank per iteration; barrier before each iteration (not timed)")}
    caveats = _node_facts(run_dir, meta) + ([unfinished] if unfinished else [])
    meta["partial"] = unfinished is not None
    if meta.get("backend") == "gloo" and meta.get("nnodes", 1) == 1:
        caveats.append("gloo over loopback TCP on shared CPU cores: alpha and beta describe this host's memory "
                       "and loopback, not a network; collectives compete with compute for the cores.")
        if "reduce_scatter" in cal["ops"]:
            caveats.append("gloo's reduce_scatter_tensor is an all-reduce followed by taking a chunk: it moves "
                           "about twice the data of a real reduce-scatter, so it will not follow the "
                           "reduce-scatter formula; compare its fit with the all-reduce fit.")
        if "ps" in cal["ops"]:
            caveats.append("ps on gloo is its reduce (a ring reduce-scatter + a gather into rank 0) then its "
                           "broadcast (a binomial tree), not one server link: see dtlab.model.psmodel.")
    if meta.get("oversubscribed"):
        caveats.append(f"{meta.get('world_size')} ranks on {meta.get('cpu_cores')} cores: oversubscribed.")
        over = [int(k) for k in sorted(samples["nproc"].unique()) if k > (meta.get("cpu_cores") or k)] \
            if not samples.empty else []
        if over:
            caveats.append(f"timed on more ranks than the {meta.get('cpu_cores')} cores (p = "
                           f"{', '.join(map(str, over))}): those samples share the cores, oversubscribed.")

    profile = Profile.from_samples(samples, meta=meta, form=cal.get("form", "ring"), caveats=caveats,
                                   min_bytes=cal.get("fit_min_bytes"), max_bytes=cal.get("fit_max_bytes"))
    profile.save(run_dir)
    return profile


def _node_facts(run_dir: str, meta: dict) -> list[str]:
    """Add where every rank ran (meta['ranks']: rank, node, local_rank, host; meta['hosts']) and the link a
    dtlab.emulate sweep crossed (meta['emulation']); return the caveats a multi-node profile needs."""
    import glob

    from dtlab.results import read_events
    starts = [next(iter(read_events(p)), {}) for p in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.jsonl")))]
    meta["ranks"] = sorted(({k: e.get(k) for k in ("rank", "node", "local_rank", "host")} for e in starts
                            if e.get("kind") == "start"), key=lambda e: e["rank"])
    meta["hosts"] = sorted({e["host"] for e in meta["ranks"]})
    if os.path.exists(os.path.join(run_dir, "emulation.json")):
        with open(os.path.join(run_dir, "emulation.json")) as f:
            meta["emulation"] = json.load(f)
    nodes = len({e["node"] for e in meta["ranks"]})
    if nodes < 2:
        return []
    link = meta.get("emulation", {}).get("link", "")
    where = (f"emulated on one host ({link or 'loopback TCP: no network at all'})" if len(meta["hosts"]) == 1
             else f"hosts {', '.join(meta['hosts'])}")
    per = meta.get("ranks_per_node", 1)
    return [f"{len(meta['ranks'])} ranks on {nodes} nodes, {per} per node, {where}: "
            + ("every collective crosses the inter-node link." if per == 1 else
               "a flat ring mixes intra- and inter-node hops; the slower link sets beta.")]
