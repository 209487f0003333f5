"""DDP gradient buckets: size-based layout and a single-channel queue model.

All times are seconds, all sizes bytes.

DistributedDataParallel groups gradients into buckets and launches one
all-reduce per bucket as soon as every gradient in it is ready. Buckets are
all-reduced in launch order on one communication stream, so a bucket can
wait twice: for its last gradient (``ready``) and for the previous bucket's
all-reduce to finish (queueing). :func:`simulate_queue` models exactly that,
and :func:`predict_step` turns it into a step time and the exposed
(non-overlapped) communication.
"""

from __future__ import annotations

import numpy as np

from dtlab.intervals import union_length

#: DDP's default cap for the first bucket (torch's _DEFAULT_FIRST_BUCKET_BYTES).
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


def mb_to_bytes(bucket_mb: float) -> int:
    """Convert DDP's ``bucket_cap_mb`` to bytes.

    DDP treats the "MB" as MiB: bytes = int(bucket_mb * 1024 * 1024).
    """
    if not np.isfinite(bucket_mb) or bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be a finite number > 0 (MiB), got {bucket_mb!r}")
    return int(bucket_mb * 1024 * 1024)


def bucket_layout(
    param_nbytes_in_ready_order, bucket_cap_bytes, first_bucket_cap_bytes=DEFAULT_FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Assign tensors to buckets by size, the way DDP does.

    param_nbytes_in_ready_order: gradient sizes in bytes, in the order the
    gradients become ready (for DDP, roughly reverse registration order).
    Returns a list of buckets, each a list of *indices* into that sequence.

    Tensors are appended to the current bucket; the bucket is closed as soon
    as its size reaches its cap (>=). The first bucket uses
    ``first_bucket_cap_bytes``, later ones ``bucket_cap_bytes``. DDP uses a
    small (1 MiB) first bucket only when constructed without bucket_cap_mb;
    dtlab always passes bucket_cap_mb, and then the first cap equals the cap
    (torch 2.13; checked byte for byte against a measured DistilBERT run). A tensor larger than the cap therefore
    closes its bucket immediately: in effect it gets a bucket of its own
    (unless it joins a partially filled one). The last bucket may be under
    its cap. Simplification: real DDP also splits buckets by dtype and
    device; here all tensors are assumed to share both.
    """
    sizes = [int(s) for s in param_nbytes_in_ready_order]
    if any(s < 0 for s in sizes):
        raise ValueError("param_nbytes_in_ready_order must contain sizes >= 0 (bytes)")
    for name, cap in (("bucket_cap_bytes", bucket_cap_bytes), ("first_bucket_cap_bytes", first_bucket_cap_bytes)):
        if cap <= 0:
            raise ValueError(f"{name} must be > 0 (bytes), got {cap!r}")

    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    cap = first_bucket_cap_bytes
    for i, s in enumerate(sizes):
        current.append(i)
        filled += s
        if filled >= cap:
            buckets.append(current)
            current, filled, cap = [], 0, bucket_cap_bytes
    if current:
        buckets.append(current)
    return buckets


def bucket_sizes(param_nbytes_in_ready_order, layout) -> np.ndarray:
    """Total bytes of each bucket of ``layout`` (from :func:`bucket_layout`)."""
    sizes = np.asarray(param_nbytes_in_ready_order, dtype=np.int64)
    return np.array([int(sizes[idx].sum()) for idx in layout], dtype=np.int64)


def _as_1d(name: str, x) -> np.ndarray:
    a = np.atleast_1d(np.asarray(x, dtype=float))
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one entry per bucket), got shape {a.shape}")
    if np.any(~np.isfinite(a)):
        raise ValueError(f"{name} must be finite (seconds)")
    return a


def simulate_queue(ready, durations, loaded=None, busy_until=None) -> tuple[np.ndarray, np.ndarray]:
    """Simulate buckets sharing one communication channel, in the order given.

    ready[i]: seconds at which bucket i's last gradient is ready;
    durations[i]: seconds its all-reduce takes once started. Bucket i starts
    at max(ready[i], end[i-1]) and ends at start[i] + durations[i]; order is
    launch order, so a bucket never overtakes an earlier one even if it is
    ready first. Returns (start, end) arrays in seconds.

    Contention: with `loaded` (seconds each all-reduce takes while backward
    compute shares the machine, from a loaded calibration) and `busy_until`
    (seconds at which backward compute ends), a bucket in service before
    `busy_until` progresses at the loaded rate (1 / loaded[i] of its work per
    second) and at the idle rate (1 / durations[i]) after it: a bucket that
    starts loaded and finishes idle ends at busy_until + (1 - f) durations[i],
    where f = (busy_until - start[i]) / loaded[i] is the part done under load.
    """
    r = _as_1d("ready", ready)
    d = _as_1d("durations", durations)
    if r.shape != d.shape:
        raise ValueError(f"ready and durations must have the same length, got {r.size} and {d.size}")
    if np.any(d < 0):
        raise ValueError("durations must be >= 0 (seconds)")
    if (loaded is None) != (busy_until is None):
        raise ValueError("loaded and busy_until go together: both (contention) or neither")
    ld = None
    if loaded is not None:
        ld = _as_1d("loaded", loaded)
        if ld.shape != d.shape or np.any(ld < 0):
            raise ValueError("loaded must have one duration >= 0 (seconds) per bucket")
        if not np.isfinite(busy_until):
            raise ValueError(f"busy_until must be finite (seconds), got {busy_until!r}")
    start = np.empty_like(r)
    end = np.empty_like(r)
    prev_end = -np.inf
    for i in range(r.size):
        start[i] = max(r[i], prev_end)
        if ld is None or start[i] >= busy_until or ld[i] == 0:
            end[i] = start[i] + d[i]
        elif start[i] + ld[i] <= busy_until:
            end[i] = start[i] + ld[i]
        else:
            done = (busy_until - start[i]) / ld[i]
            end[i] = busy_until + (1.0 - done) * d[i]
        prev_end = end[i]
    return start, end


def replay_ranks(issues, durations, loaded=None, busy_until=None) -> dict:
    """Replay one step's buckets as every rank issued them, on one shared clock (seconds).

    issues: one row per rank, one column per bucket (the same collective on every rank, in issue order): when
    that rank issued it. A collective can run only once the last rank has issued it, and one at a time (one
    channel): bucket k starts at max(max over ranks of issues[:, k], end of bucket k-1) and ends after its
    duration (idle `durations`; with contention, `loaded` until `busy_until`, see :func:`simulate_queue`). A rank
    that issued early waits for its peers: that wait is in its T_comm, as the recorder measures it.

    Returns start, end (arrays per bucket) and t_comm (per rank: the union of its [issue, end] intervals)."""
    iss = np.atleast_2d(np.asarray(issues, dtype=float))
    if iss.ndim != 2 or iss.shape[1] != _as_1d("durations", durations).size:
        raise ValueError(f"issues must have one row per rank and one column per bucket, got shape {iss.shape}")
    start, end = simulate_queue(iss.max(axis=0), durations, loaded, busy_until)
    t_comm = np.array([union_length(zip(row, end)) for row in iss])
    return {"start": start, "end": end, "t_comm": t_comm}


def predict_step(t_fwd, t_bwd_comp, t_opt, ready, durations, loaded=None) -> dict:
    """Predict one DDP step from compute times and bucket communication.

    t_fwd, t_bwd_comp, t_opt: seconds of forward, backward compute and
    optimizer. ready: seconds from *step start* at which each bucket is
    ready (typically between t_fwd and t_fwd + t_bwd_comp); durations:
    all-reduce seconds per bucket; loaded: the same while backward compute
    still runs (contention, see simulate_queue; None: the idle price throughout).
    The optimizer waits for both backward compute (ends at t_fwd + t_bwd_comp)
    and the last all-reduce.

    Returns a dict (seconds unless noted):
      t_comm      time in flight: the length of the union of [ready, end]
                  intervals (a queued bucket is in flight from its issue, as
                  the recorder measures it)
      t_busy      sum of service times (end - start)
      t_comm_end  end of the last all-reduce (0.0 when there are no buckets)
      exposed     max(0, t_comm_end - (t_fwd + t_bwd_comp)), communication
                  not hidden behind backward compute
      t_step      t_fwd + max(t_bwd_comp, t_comm_end - t_fwd) + t_opt
      t_comp      t_fwd + t_bwd_comp + t_opt
      overlap     1 - exposed / t_comm (fraction hidden, dimensionless); NaN
                  when t_comm == 0, because a fraction of nothing is
                  undefined and NaN keeps such points out of plots/means
      start, end  arrays from :func:`simulate_queue`
    """
    for name, v in (("t_fwd", t_fwd), ("t_bwd_comp", t_bwd_comp), ("t_opt", t_opt)):
        if not np.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be finite and >= 0 (seconds), got {v!r}")
    bwd_end = t_fwd + t_bwd_comp
    start, end = simulate_queue(ready, durations, loaded, None if loaded is None else bwd_end)
    t_busy = float(np.sum(end - start))
    t_comm = union_length(zip(np.minimum(_as_1d("ready", ready), start), end))
    t_comm_end = float(end[-1]) if end.size else 0.0
    exposed = max(0.0, t_comm_end - bwd_end)
    return {
        "t_comm": t_comm,
        "t_busy": t_busy,
        "t_comm_end": t_comm_end,
        "exposed": exposed,
        "t_step": float(t_fwd + max(t_bwd_comp, t_comm_end - t_fwd) + t_opt),
        "t_comp": float(t_fwd + t_bwd_comp + t_opt),
        "overlap": 1.0 - exposed / t_comm if t_comm > 0 else float("nan"),
        "start": start,
        "end": end,
    }


def whatif_ready_times(t_fwd, t_bwd_comp, bucket_nbytes, curve=None) -> np.ndarray:
    """Bucket ready times (seconds from step start) if backward compute is
    spread over the buckets in proportion to their bytes, or along a measured
    readiness `curve`.

    Bucket i is ready at t_fwd + t_bwd_comp * f(cumsum(bytes)[i] / sum(bytes)),
    so the last bucket is ready exactly when backward compute ends. Without
    `curve`, f(x) = x: a "what if" assumption (compute per byte is uniform),
    not a measurement. With `curve` = (byte_fractions, time_fractions), both
    rising from 0 to 1 (:func:`ready_curve` of a measured run), f is its
    piecewise-linear interpolation: the fraction of backward compute done when
    that fraction of the gradient bytes is ready (DistilBERT's word embedding
    holds 35% of the bytes and is ready last, after a small part of backward).
    """
    b = _as_1d("bucket_nbytes", bucket_nbytes)
    if np.any(b < 0):
        raise ValueError("bucket_nbytes must be >= 0 (bytes)")
    total = b.sum()
    if total <= 0:
        raise ValueError("bucket_nbytes must have a positive sum (bytes) to spread backward compute over")
    x = np.cumsum(b) / total
    if curve is None:
        return t_fwd + t_bwd_comp * x
    xs, ys = (_as_1d(name, v) for name, v in zip(("curve bytes", "curve time"), curve))
    if xs.shape != ys.shape or xs.size < 2 or np.any(np.diff(xs) < 0) or np.any(np.diff(ys) < 0):
        raise ValueError("curve must be two rising sequences of equal length >= 2 (byte and time fractions)")
    if xs[0] != 0 or ys[0] != 0 or xs[-1] != 1 or ys[-1] != 1:
        raise ValueError("curve must run from (0, 0) to (1, 1): fractions of the bytes and of backward compute")
    return t_fwd + t_bwd_comp * np.interp(x, xs, ys)


def ready_curve(steps) -> tuple[np.ndarray, np.ndarray]:
    """The readiness curve of measured steps, for :func:`whatif_ready_times`: (byte fractions, time fractions).

    steps: one (t_bwd_start, ready, nbytes) per step, the buckets in issue order: seconds at which backward
    began (the end of forward), each bucket's ready time (seconds, same clock) and bytes. Per step, bucket k's
    point is (bytes of buckets 0..k / all bytes, (ready[k] - t_bwd_start) / (ready[last] - t_bwd_start)): the
    last bucket's readiness is taken as the end of backward compute, as :func:`whatif_ready_times` does. The
    curve is the median over steps per bucket, made non-decreasing, from (0, 0) to (1, 1)."""
    xs, ys = [], []
    for start, ready, nbytes in steps:
        r, n = _as_1d("ready", ready), _as_1d("nbytes", nbytes)
        span = r[-1] - start if r.size else 0.0
        if r.size != n.size or r.size == 0 or span <= 0 or n.sum() <= 0:
            continue
        xs.append(np.cumsum(n) / n.sum())
        ys.append(np.clip((r - start) / span, 0.0, 1.0))
    if not xs or len({x.size for x in xs}) != 1:
        raise ValueError("steps must give at least one step, every step the same buckets, ready after t_bwd_start")
    x = np.median(np.vstack(xs), axis=0)
    y = np.maximum.accumulate(np.median(np.vstack(ys), axis=0))
    return np.concatenate([[0.0], x[:-1], [1.0]]), np.concatenate([[0.0], y[:-1], [1.0]])
