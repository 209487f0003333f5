"""What ranks sharing one machine cost each other's compute, for the what-if (dtlab.model.whatif):

- compute slowed by the communication beside it: the backward seconds a rank loses per second of collectives in
  flight, fitted from a loaded calibration (:func:`fit_stretch`), and the stretched backward pass it predicts
  (:func:`stretched_backward`);
- compute slowed by the other ranks' compute on shared CPU cores: the fair share of the cores, and where a loaded
  calibration timed a rank's backward pass alone beside all ranks' together (:func:`fit_alone`), that measured
  ratio, which also holds the caches and memory bandwidth the ranks share (:func:`cpu_share_scale`);
- communication slowed by compute beside it: how many times longer a loaded calibration's all-reduce took than its
  idle one (:func:`contention_from_profile`, a Link's contention).

Communication beside compute:

A bucket's all-reduce is not free for the compute it overlaps. On CPU ranks gloo's threads and the kernel's TCP
stack (and, across an emulated link, its queueing discipline) run on the cores the backward pass runs on; on a GPU
NCCL's kernels take SMs and memory bandwidth from the backward kernels. The no-op hook steps a run pairs with its
training steps measure compute with nothing in flight, so a model fed with them misses that time.

A loaded calibration (`dtlab.calibrate(..., load='backward')`, dtlab.rank.contention) replays backward passes with
collectives of every size issued from inside them, and passes with nothing in flight. For each rank:
extra = (pass seconds - seconds its hooks waited) - the median of its passes with nothing in flight, and
`per_second` = sum(extra) / sum(seconds in flight while computing) over the loaded passes: backward seconds lost per
second of communication in flight (0: none). :func:`stretched_backward` applies it in the what-if: a backward pass
of `t_bwd` seconds with `in_flight` seconds of its collectives in service during it takes
t_bwd + per_second x in_flight, solved for the pass's own length (the ready times stretch with it).
"""

from __future__ import annotations

import numpy as np

from dtlab.intervals import union_length
from dtlab.model.buckets import simulate_queue

#: Bootstrap resamples for the interval of `per_second` (passes resampled, seeded: the same figures every time).
RESAMPLES = 400


def fit_stretch(passes) -> dict | None:
    """The stretch of backward compute by communication in flight, from a loaded calibration's passes.

    passes: dicts (or a DataFrame's records) with rank, idle (True: nothing issued from the pass), seconds (the pass's
    wall time), waited (its hooks' waits for a collective, s) and in_flight (seconds collectives were in flight while
    it computed). Returns {per_second, lo, hi (a 90% bootstrap interval over the loaded passes), idle_pass_s (the
    median pass with nothing in flight, s), passes (loaded passes used), idle_passes, how}; None when a rank has no
    idle pass or no loaded pass had anything in flight (nothing to fit)."""
    rows = [dict(p) for p in passes if p.get("seconds") is not None]
    extra, flight, idle_all = [], [], []
    for rank in sorted({int(p["rank"]) for p in rows}):
        mine = [p for p in rows if int(p["rank"]) == rank]
        idle = [float(p["seconds"]) - float(p.get("waited") or 0.0) for p in mine if p.get("idle")]
        if not idle:
            return None
        base = float(np.median(idle))
        idle_all += idle
        for p in mine:
            f = float(p.get("in_flight") or 0.0)
            if not p.get("idle") and f > 0:
                extra.append(float(p["seconds"]) - float(p.get("waited") or 0.0) - base)
                flight.append(f)
    if not flight:
        return None
    extra, flight = np.asarray(extra), np.asarray(flight)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(flight), size=(RESAMPLES, len(flight)))
    boot = extra[picks].sum(axis=1) / flight[picks].sum(axis=1)
    lo, hi = np.quantile(boot, [0.05, 0.95])
    return {
        "per_second": max(0.0, float(extra.sum() / flight.sum())),
        "lo": max(0.0, float(lo)),
        "hi": max(0.0, float(hi)),
        "idle_pass_s": float(np.median(idle_all)),
        "passes": int(len(flight)),
        "idle_passes": int(len(idle_all)),
        "how": "sum over loaded passes of (pass - hook waits - the rank's median idle pass) / sum of seconds in "
        "flight while computing; at least 0",
    }


def stretch_from_profile(profile) -> tuple[float, str]:
    """(per_second, where it comes from): the backward seconds lost per second of communication in flight that
    `profile`'s loaded calibration measured (:func:`fit_stretch`), or (0.0, why none) without one."""
    st = ((profile.meta or {}).get("load") or {}).get("stretch") if profile is not None else None
    if not st:
        return 0.0, "none assumed: no loaded calibration with passes to fit (dtlab.calibrate(..., load='backward'))"
    return float(st["per_second"]), (
        f"measured: {st['passes']} backward passes with collectives in flight against {st['idle_passes']} without, "
        f"{st['per_second']:.2f} s of compute lost per s in flight [{st['lo']:.2f}..{st['hi']:.2f}] (this profile)"
    )


def sharing_from_profile(profile, cpu: dict | None = None) -> dict:
    """dtlab.model.whatif.whatif's keyword arguments for what sharing the machine costs compute, as `profile`'s
    loaded calibration measured it: "stretch" (:func:`stretch_from_profile`; 0 without one) and "cpu" (`cpu`,
    dtlab.model.whatif.compute_from_run's, with the profile's lone-rank figure (:func:`fit_alone`) added where it
    has one; None stays None: a device per rank), and "how": a line saying where each comes from."""
    stretch, how = stretch_from_profile(profile)
    alone = (((profile.meta or {}).get("load") or {}).get("alone")) if profile is not None else None
    lines = [f"compute lost to communication in flight: {how}"]
    if cpu is not None and alone:
        cpu = dict(cpu, alone=alone)
        lines.append(
            f"a rank's compute alone: {alone['ratio']:.2f}x its compute beside {alone['ranks'] - 1} other(s) "
            "(measured: this profile's passes alone and together; the fair share of the cores elsewhere)"
        )
    elif cpu is not None:
        lines.append("a rank's compute alone: the fair share of the cores (assumed: the profile timed no pass alone)")
    return {"stretch": stretch, "cpu": cpu, "how": "\n".join(lines)}


def stretched_backward(t_fwd, t_bwd_comp, ready, durations, loaded=None, stretch: float = 0.0):
    """(t_bwd, ready): backward compute and bucket ready times (s) with `stretch` (>= 0) seconds of compute lost
    per second of communication in service during backward. The pass's length b solves
    b = t_bwd_comp + stretch x (service time of the queue inside [t_fwd, t_fwd + b]), with ready times stretched
    in proportion (a bucket ready at a fraction of backward stays at that fraction); `loaded` as in
    :func:`dtlab.model.buckets.simulate_queue`. The service time inside the pass is at most the queue's total, so
    b lies between t_bwd_comp and t_bwd_comp + stretch x sum(durations). Below stretch 1 a few fixed-point steps
    from t_bwd_comp find it (each step's change shrinks by stretch or more); otherwise, or if they have not settled,
    bisection in that range (at stretch >= 1, collectives in flight the whole pass hold it until they end)."""
    if not np.isfinite(stretch) or stretch < 0:
        raise ValueError(
            f"stretch (backward seconds lost per second of communication in flight) must be a finite number >= 0, "
            f"got {stretch!r}"
        )
    ready = np.asarray(ready, dtype=float)
    base = float(t_bwd_comp)
    if stretch == 0 or base <= 0 or ready.size == 0:
        return base, ready

    def at(b):
        return t_fwd + (ready - t_fwd) * (b / base)

    def excess(b):  # base + stretch x (service inside the pass of length b) - b: falls to 0 at the solution
        start, end = simulate_queue(at(b), durations, loaded, None if loaded is None else t_fwd + b)
        lo, hi = t_fwd, t_fwd + b
        inside = union_length((max(s, lo), min(e, hi)) for s, e in zip(start, end) if min(e, hi) > max(s, lo))
        return base + stretch * inside - b

    tol = 1e-9 * max(1.0, base)  # seconds: far below any figure the model is compared with
    b = base
    for _ in range(50 if stretch < 1 else 0):
        step = excess(b)
        b += step
        if abs(step) < tol:
            return b, at(b)
    lo, hi = base, base + stretch * float(np.sum(np.asarray(durations, dtype=float))) + 1e-12
    for _ in range(100):
        if hi - lo < tol:
            break
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return hi, at(hi)


def fit_alone(passes) -> dict | None:
    """A rank's backward pass alone against all ranks' together, from a loaded calibration's passes with nothing
    in flight: `solo` passes (one rank computes, the others wait at a barrier) and the others. Returns {ranks (how
    many computed together), alone_s, together_s (medians, s), ratio (alone / together), passes}; None without
    both kinds."""
    idle = [p for p in passes if p.get("idle") and p.get("seconds") is not None]
    alone = [float(p["seconds"]) for p in idle if p.get("solo")]
    together = [float(p["seconds"]) for p in idle if not p.get("solo")]
    ranks = len({int(p["rank"]) for p in idle})
    if not alone or not together or ranks < 2:
        return None
    a, t = float(np.median(alone)), float(np.median(together))
    return {"ranks": ranks, "alone_s": a, "together_s": t, "ratio": a / t, "passes": len(alone) + len(together)}


def cpu_share_scale(nproc: int, cpu: dict | None) -> float:
    """How many times longer a rank's compute takes at `nproc` ranks than where it was measured, when the ranks
    share one machine's CPU cores; 1.0 for `cpu` None (a device per rank: compute independent of p).

    cpu: {"cores": C, "nproc": p0 (ranks that shared the cores when compute was measured), "threads_per_rank": t,
    "other_cores": o (other processes' load, cores' worth, while it was measured; 0 if unknown)}, as
    dtlab.model.whatif.compute_from_run gives it, and optionally "alone": :func:`fit_alone` of a calibration on
    these cores. Fair share: demand d(p) = p t + o cores; a rank runs f(p) = max(1, d(p) / C) times slower than on
    cores of its own. With "alone" (measured at k = its ranks): a rank's slowdown is 1 alone, 1 / ratio at k, and
    f(p) / f(k) / ratio at any other p (the fair share from there); the result is slowdown(nproc) / slowdown(p0).
    E.g. C = 2, t = 1, o = 0: 3 ranks take 1.5x the compute of 2, and 1 rank the same as 2 by the fair share,
    `ratio` x the compute of 2 where measured."""
    if cpu is None:
        return 1.0
    cores, p0 = float(cpu["cores"]), int(cpu["nproc"])
    t, o = float(cpu.get("threads_per_rank", 1)), float(cpu.get("other_cores") or 0.0)
    if not (np.isfinite(cores) and cores > 0 and p0 >= 1 and t > 0 and np.isfinite(o) and o >= 0):
        raise ValueError(f"cpu needs cores > 0, nproc >= 1, threads_per_rank > 0 and other_cores >= 0, got {cpu!r}")
    alone = cpu.get("alone")
    if alone is not None and not (alone.get("ratio", 0) > 0 and int(alone.get("ranks", 0)) >= 2):
        raise ValueError(f"cpu['alone'] needs ratio > 0 and ranks >= 2 (dtlab.model.sharing.fit_alone), got {alone!r}")

    def fair(p):
        return max(1.0, (p * t + o) / cores)

    def slowdown(p):
        if alone is None:
            return fair(p)
        k = int(alone["ranks"])
        return 1.0 if p == 1 else fair(p) / fair(k) / float(alone["ratio"])

    return slowdown(int(nproc)) / slowdown(p0)


def contention_from_profile(profile, nbytes: float, nproc: int | None = None) -> tuple[float, str]:
    """(factor, where it comes from): how many times longer an all-reduce of `nbytes` took beside a replayed
    backward pass than idle in `profile` (its loaded and idle fits, at p = `nproc` or the largest p timed), at
    least 1; (1.0, why not) for a profile without a loaded fit."""
    if profile is None or not profile.has_load("all_reduce"):
        return 1.0, "none assumed: no loaded calibration (dtlab.calibrate(..., load='backward') measures it)"
    timed = profile.samples["nproc"] if "nproc" in profile.samples.columns else []
    p = int(nproc or (max(timed) if len(timed) else 2))
    idle = float(profile.predict("all_reduce", nbytes, p))
    loaded = float(profile.predict("all_reduce", nbytes, p, load="backward"))
    factor = max(1.0, loaded / idle) if idle > 0 else 1.0
    model = profile.meta.get("load", {}).get("model", "a model")
    return factor, (
        f"measured: loaded / idle all-reduce fit at {nbytes / 2**20:.3g} MiB, p = {p}, this profile "
        f"(beside {model}'s backward pass)"
    )
