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

Run this module as a rank entry point: `torchrun ... -m dtlab.calibration RUN_DIR`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass

OPS = ("all_reduce", "reduce_scatter", "all_gather")
# Powers of 2 from 4 KiB to 64 MiB: 15 sizes spanning the latency- and bandwidth-bound regimes, dense
# enough that each protocol regime gets several points (see dtlab.fit.fit_piecewise).
DEFAULT_SIZES = tuple(2 ** k for k in range(12, 27))


@dataclass(kw_only=True)
class CalibConfig:
    """What to measure. Sizes are full message bytes (nccl-tests convention), rounded up to a multiple of
    4 * nproc so every rank's share is a whole number of fp32 elements."""

    nproc: int = 2
    """Ranks taking part (at least 2: a collective needs peers); placed like a run's (dtlab.placement)."""
    ops: tuple = ("all_reduce",)
    """Collectives to time: all_reduce, reduce_scatter, all_gather."""
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
    """Which alpha-beta form the profile fits: 'ring' or 'textbook' (see dtlab.costmodel)."""
    fit_min_bytes: int | None = None
    """Fit only sizes >= this (collectives switch protocol between small and large messages)."""
    fit_max_bytes: int | None = None
    """Fit only sizes <= this."""
    out: str | None = None
    """Profile directory; default profiles/calib-p<nproc>-<timestamp>."""
    timeout_s: float = 1800.0
    """Wall-clock limit for the whole sweep in seconds; past it every rank is stopped."""

    def __post_init__(self) -> None:
        if isinstance(self.ops, str):
            self.ops = tuple(o.strip() for o in self.ops.split(",") if o.strip())
        self.ops, self.sizes = tuple(self.ops), tuple(self.sizes)

    def validate(self, cuda_device_count: int | None = None) -> "CalibConfig":
        """Refuse bad fields by name, before anything starts."""
        from .config import BACKENDS, RunConfig, _choice, _int_at_least
        _int_at_least("nproc", self.nproc, 2)  # a collective needs peers
        if not self.ops or any(o not in OPS for o in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {', '.join(OPS)}, got {list(self.ops)!r}")
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 for s in self.sizes):
            raise ValueError(f"sizes must be a non-empty list of integers >= 4 (bytes), got {list(self.sizes)!r}")
        _int_at_least("warmup", self.warmup, 0)
        _int_at_least("iters", self.iters, 1)
        _int_at_least("rounds", self.rounds, 1)
        if self.batch is not None:
            _int_at_least("batch", self.batch, 1)
        if self.rounds > self.iters:
            raise ValueError(f"rounds must be <= iters ({self.iters}) so every round times each size, got {self.rounds}")
        _choice("backend", self.backend, BACKENDS)
        _choice("form", self.form, ("ring", "textbook"))
        for name in ("fit_min_bytes", "fit_max_bytes"):
            if getattr(self, name) is not None:
                _int_at_least(name, getattr(self, name), 0)
        from .config import _finite
        _finite("timeout_s", self.timeout_s, "(seconds)", low=0.0)
        # The machine checks (nccl needs CUDA, one GPU per rank) are the training runs' own.
        RunConfig(nproc=self.nproc, backend=self.backend).validate(cuda_device_count)
        return self

    def resolved_backend(self) -> str:
        from .config import RunConfig
        return RunConfig(nproc=self.nproc, backend=self.backend).resolved_backend()

    def rounded_sizes(self) -> list[int]:
        unit = 4 * self.nproc
        return sorted({-(-s // unit) * unit for s in self.sizes})


def calibrate(nproc: int = 2, ops=("all_reduce",), sizes=DEFAULT_SIZES, *, warmup: int = 3, iters: int = 12,
              rounds: int = 3, backend: str = "auto", form: str = "ring", fit_min_bytes: int | None = None,
              fit_max_bytes: int | None = None, out: str | None = None, timeout_s: float = 1800.0,
              batch: int | None = None, progress: bool = True):
    """Measure the collectives, fit alpha and beta, save and return the machine `Profile` (see dtlab.fit).

    sizes are full message bytes; `batch` calls are timed back to back per sample (default: 20 on CUDA, 1 on
    gloo-CPU); the fit can be limited to [fit_min_bytes, fit_max_bytes]; the profile is
    written to OUT/profile.json and read back with `dtlab.load_profile(OUT)`."""
    return launch_calibration(CalibConfig(nproc=nproc, ops=ops, sizes=tuple(sizes), warmup=warmup, iters=iters,
                                          rounds=min(rounds, iters), backend=backend, form=form, fit_min_bytes=fit_min_bytes,
                                          fit_max_bytes=fit_max_bytes, out=out, timeout_s=timeout_s,
                                          batch=batch)).wait(progress=progress)


def launch_calibration(cfg: CalibConfig):
    """Start a calibration sweep; returns a launcher Handle whose wait() gives the Profile."""
    from .config import dump_json
    from .launcher import Handle, _write_status, prepare_dir, start_torchrun, unique_dir

    cfg.validate()
    out = prepare_dir(cfg.out or unique_dir("profiles", f"calib-p{cfg.nproc}"))
    cfg = dataclasses.replace(cfg, out=out)
    backend = cfg.resolved_backend()
    dump_json({"calibration": dataclasses.asdict(cfg), "launch": {"time": time.time(), "backend": backend}},
              os.path.join(out, "config.json"))
    proc = start_torchrun(out, cfg.nproc, "dtlab.calibration", gloo_threads=backend == "gloo")
    _write_status(out, "running", pid=proc.pid, started=time.time())
    total = cfg.rounds  # progress counts rounds; each round times every (op, size)
    return Handle(out, proc, cfg.nproc, total, cfg.timeout_s, f"calibrate {','.join(cfg.ops)} x{cfg.nproc} ({backend})",
                  loader=load_calibration, unit="round")


def samples_frame(run_dir: str):
    """The raw samples of a calibration directory: one row per rank and timed iteration, plus the slowest
    rank per iteration as `seconds` (columns op, nbytes, nproc, iter, seconds, rank_spread)."""
    import glob

    import pandas as pd

    from .results import read_events
    rows = [e for p in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.jsonl")))
            for e in read_events(p) if e.get("kind") == "sample"]
    raw = pd.DataFrame(rows, columns=["rank", "op", "nbytes", "nproc", "iter", "seconds"])
    if raw.empty:
        return raw, raw
    g = raw.groupby(["op", "nbytes", "nproc", "iter"])["seconds"]
    slow = g.max().rename("seconds").to_frame()
    slow["rank_spread"] = g.max() - g.min()
    return raw, slow.reset_index()


def load_calibration(run_dir: str):
    """Fit (or re-fit) the samples of a calibration directory, write profile.json, return the Profile.
    Raises RunFailed when the sweep did not finish, with whatever samples were recorded attached."""
    from .fit import Profile
    from .results import RunFailed

    with open(os.path.join(run_dir, "config.json")) as f:
        doc = json.load(f)
    cal = doc["calibration"]
    raw, samples = samples_frame(run_dir)
    status = {}
    if os.path.exists(os.path.join(run_dir, "status.json")):
        with open(os.path.join(run_dir, "status.json")) as f:
            status = json.load(f)
    if status.get("state") not in (None, "finished"):
        raise RunFailed(f"calibration {status.get('state')}: see {run_dir}/logs", error=status.get("state"),
                        run_dir=run_dir, run=samples)
    meta = {**doc.get("resolved", {}), "calibration": cal, "rank_samples": len(raw),
            "timing": doc.get("resolved", {}).get("timing",
                                                   "slowest rank per iteration; barrier before each iteration (not timed)")}
    caveats = []
    if meta.get("backend") == "gloo":
        caveats.append("gloo over loopback TCP on shared CPU cores: alpha and beta describe this host's memory "
                       "and loopback, not a network; collectives compete with compute for the cores.")
        if "reduce_scatter" in cal["ops"]:
            caveats.append("gloo's reduce_scatter_tensor is an all-reduce followed by taking a chunk: it moves "
                           "about twice the data of a real reduce-scatter, so it will not follow the "
                           "reduce-scatter formula; compare its fit with the all-reduce fit.")
    if meta.get("oversubscribed"):
        caveats.append(f"{meta.get('world_size')} ranks on {meta.get('cpu_cores')} cores: oversubscribed.")
    profile = Profile.from_samples(samples, meta=meta, form=cal.get("form", "ring"), caveats=caveats,
                                   min_bytes=cal.get("fit_min_bytes"), max_bytes=cal.get("fit_max_bytes"))
    profile.save(run_dir)
    return profile


# ---- the rank side ----------------------------------------------------------------------------------------

def _rank_main(run_dir: str) -> int:
    """A calibration rank: the one rank lifecycle (dtlab.lifecycle.rank_main) around the sweep."""
    from .lifecycle import rank_main, read_config

    def body(run_dir, rank, world, writer):
        _sweep(CalibConfig(**read_config(run_dir)["calibration"]), run_dir, rank, world, writer)

    return rank_main(run_dir, body)


def _sweep(cfg: CalibConfig, run_dir: str, rank: int, world: int, writer) -> None:
    import torch
    import torch.distributed as dist

    from .config import RunConfig
    from .lifecycle import record_resolved, setup_distributed

    rc = RunConfig(nproc=cfg.nproc, backend=cfg.backend)
    device, backend = setup_distributed(rc, rank, world)
    cuda = device.type == "cuda"
    k_calls = cfg.batch or (20 if cuda else 1)
    if rank == 0:
        timing = (f"slowest rank per sample; each sample = CUDA events around {k_calls} back-to-back calls / "
                  f"{k_calls}, devices aligned by a tiny all_reduce just before the start event (no host barrier)"
                  if cuda else f"slowest rank per sample; host barrier (not timed), then wall clock around "
                               f"{k_calls} blocking call(s) / {k_calls}")
        algo = {k: os.environ[k] for k in ("NCCL_ALGO", "NCCL_PROTO") if k in os.environ}
        record_resolved(run_dir, rc, backend, device, {
            "what": "collective calibration", "timing": timing, "calls_per_sample": k_calls,
            "nccl_algo_proto": algo or ("chosen by NCCL's tuner per size (torch does not expose the choice; pin "
                                        "it with NCCL_ALGO / NCCL_PROTO)" if backend == "nccl" else None)}, world)
    align = torch.zeros(1, device=device)
    warm = torch.ones(1 << 20, device=device)
    for _ in range(3):  # connections and buffers are set up lazily: pay for that before any timed size
        dist.all_reduce(warm)
    calls = {}
    for op in cfg.ops:
        for nbytes in cfg.rounded_sizes():
            calls[(op, nbytes)] = _collective(op, nbytes, world, device)
    # Rounds of warmed-up blocks: each round visits every (op, size) in an order shuffled per round (same on
    # all ranks), and times a short block of it after `warmup` untimed calls, as nccl-tests does per size. The
    # blocks give each size its steady state (a 4 KiB all-reduce right after a 64 MiB one is slower); the
    # shuffled rounds spread drift in the machine's load over all sizes instead of biasing a few.
    order = list(calls)
    rng = random.Random(0)
    per_round = [cfg.iters // cfg.rounds + (1 if r < cfg.iters % cfg.rounds else 0) for r in range(cfg.rounds)]
    it = 0
    for rnd, n_timed in enumerate(per_round):
        rng.shuffle(order)
        first = it
        for op, nbytes in order:
            call = calls[(op, nbytes)]
            for _ in range(cfg.warmup):
                call()
            for k in range(n_timed):
                if cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    dist.all_reduce(align)  # device-side alignment: completes only when every rank is here
                    a.record()
                    for _ in range(k_calls):
                        call()
                    b.record()
                    b.synchronize()
                    t = a.elapsed_time(b) / 1e3 / k_calls
                else:
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(k_calls):
                        call()  # blocking on gloo: returns when the collective has completed on this rank
                    t = (time.perf_counter() - t0) / k_calls
                writer.write("sample", rank=rank, op=op, nbytes=nbytes, nproc=world, iter=first + k, seconds=t)
        it += n_timed
        writer.write("calib", rank=rank, round=rnd, rounds=cfg.rounds)


def _collective(op: str, nbytes: int, world: int, device):
    """A zero-argument blocking call of `op` on preallocated fp32 buffers of `nbytes` (full message)."""
    import torch
    import torch.distributed as dist
    n = nbytes // 4
    if op == "all_reduce":
        x = torch.ones(n, device=device)
        return lambda: dist.all_reduce(x)
    if op == "reduce_scatter":
        x, y = torch.ones(n, device=device), torch.empty(n // world, device=device)
        return lambda: dist.reduce_scatter_tensor(y, x)
    x, y = torch.ones(n // world, device=device), torch.empty(n, device=device)
    return lambda: dist.all_gather_into_tensor(y, x)


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))
