"""Check a student's own distributed code from the notebook: `check_comm_hook(fn)`, `check_ring_allreduce(fn)`.

The function's source goes to the ranks as RUN_DIR/student.py (dtlab.course.shipping); the ranks
(dtlab.rank.harness) check it on gloo with CPU tensors; this side reads their events back and returns an
`ExerciseResult`: one row per check, the numbers behind it, and a printed verdict that names the problem. When
a rank raises, aborts or hangs, the verdict quotes its own log (dtlab.course.diagnose): the native message and
the line of the student's function. A stub whose body only raises NotImplementedError is reported as "not
implemented yet" without launching anything.

Tolerances: the hook check compares float64 parameters with torch.allclose(rtol=1e-7, atol=1e-10) (the
only difference DDP may make is the order of a sum: ~1e-16 relative); the ring check compares float32 with
rtol=1e-5, atol=1e-6 (a ring adds the p contributions in a different order than gloo does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pandas as pd

from dtlab.course.diagnose import failure_feedback
from dtlab.course.shipping import launch_check, not_implemented, ship  # noqa: F401 - ship: public, re-exported
from dtlab.model.costmodel import ring_allreduce
from dtlab.model.profile import Profile
from dtlab.results.calibration import load_profile

HOOK_DEFAULTS = dict(
    dims=[16, 32, 32, 4], batch=8, lr=0.1, init_seed=0, data_seed=1, bucket_bytes=4096, rtol=1e-7, atol=1e-10
)
RING_DEFAULTS = dict(data_seed=3, rtol=1e-5, atol=1e-6, warmup=2, iters=5)
RING_SIZES = (2, 3, 64, 1001, 65_537)  # elements (float32), including sizes p does not divide
RING_TIMING_SIZES = (2**14, 2**18, 2**21)  # bytes
#: seconds a started check may go without recording anything before it counts as hung (each size, step or
#: timing iteration records an event; the slowest takes milliseconds): a deadlock is reported in seconds
STALL_S = 20.0


@dataclass
class ExerciseResult:
    """What a check found. `status`: 'passed', 'failed', 'not implemented' or 'error' (the code raised or
    hung); `feedback`: sentences naming each problem; `checks`: one row per check (check, passed, detail);
    `per_step` (hook: step, max_abs_err, allclose, ratio) or `per_size` (ring: n, ok, max_abs_err, sends);
    `buckets` (hook: rank, step, bucket, nbytes, nparams, params, layers (the Linear layers whose gradients
    the bucket holds), t_ready, t_start, t_end and t_backward_end (when backward returned on that rank), s
    from the step start);
    `timings` (ring: nbytes, ring_ms, all_reduce_ms, model_ms); `run_dir` (None when nothing was launched);
    `notes`: what the launcher said besides (e.g. a rank that crashed in shutdown after every check finished)."""

    exercise: str
    status: str
    feedback: list = field(default_factory=list)
    checks: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["check", "passed", "detail"]))
    per_step: pd.DataFrame | None = None
    per_size: pd.DataFrame | None = None
    buckets: pd.DataFrame | None = None
    timings: pd.DataFrame | None = None
    run_dir: str | None = None
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def verdict(self) -> str:
        head = {"passed": "PASSED", "failed": "FAILED", "not implemented": "not implemented yet", "error": "ERROR"}[
            self.status
        ]
        lines = [f"{self.exercise}: {head}"]
        lines += [f"  {'ok  ' if bool(r.passed) else 'FAIL'} {r.check}: {r.detail}" for r in self.checks.itertuples()]
        lines += [f"  -> {f}" for f in self.feedback]
        lines += [f"  note (does not change the verdict): {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = verdict

    def __repr__(self) -> str:
        return self.verdict()


def _early(exercise: str, fn, events, failure, out, ex: dict) -> ExerciseResult | None:
    """The result when the code is a stub, raised, aborted or hung; None when the checks ran to the end. The
    verdict of a failure comes from the ranks' own logs (dtlab.course.diagnose): the native message and the
    line of the student's function."""
    if fn is None or not_implemented(fn) or "not_implemented" in events:
        return ExerciseResult(
            exercise,
            "not implemented",
            [
                f"{exercise}: not implemented yet: write the function "
                f"in its # EXERCISE cell (replace `raise NotImplementedError`) and run this cell again."
            ],
            run_dir=out,
        )
    if failure is None:
        return None
    if "NotImplementedError" in str(failure.error):
        return ExerciseResult(
            exercise, "not implemented", [f"{exercise}: not implemented yet ({failure.error})"], run_dir=out
        )
    logs = {}
    for r in range(int(ex.get("nproc", 2))):
        try:
            with open(os.path.join(out, "logs", f"rank{r}.log"), errors="replace") as f:
                logs[r] = f.read()
        except OSError:
            logs[r] = ""
    try:
        with open(os.path.join(out, "student.py")) as f:
            source = f.read()
    except OSError:
        source = ""
    msg = failure_feedback(
        exercise,
        failure.state,
        logs,
        source,
        ex.get("name", "your function"),
        def_line=ex.get("def_line"),
        cell_line=ex.get("cell_line"),
        written_in=ex.get("written_in", "its cell"),
        culprit=failure.rank,
        signal=failure.signal,
        error=failure.error,
        stall_s=ex.get("stall_s"),
        hung_at=_progress(exercise, events, ex),
    )
    return ExerciseResult(exercise, "error", [msg], run_dir=out)


def _progress(exercise: str, events: dict, ex: dict) -> str:
    """' at n=65,537 elements' / ' at step 2' / ' while timing': how far the checks got before a hang."""

    def done_by_all(kind, key):  # what every rank finished: the rank that is behind is where it stopped
        per = {}
        for e in events.get(kind, []):
            per.setdefault(e["rank"], set()).add(int(e[key]))
        return set.intersection(*per.values()) if len(per) == int(ex.get("nproc", 2)) else set()

    if exercise == "ring_allreduce":
        left = [n for n in ex.get("sizes", []) if n not in done_by_all("ring_size", "n")]
        return f" checking n={left[0]:,} elements" if left else " while timing"
    steps = done_by_all("hook_step", "step")
    return f" in step {max(steps) + 1 if steps else 0}"


def _check(exercise: str, fn, nproc: int, ex: dict, out, timeout_s: float, progress: bool, verdict) -> ExerciseResult:
    """Launch the check (unless `fn` is a stub), then the early verdict or `verdict(events, out)`, with the
    launcher's notes attached."""
    events, failure, out, notes = (
        ({}, None, None, [])
        if fn is None or not_implemented(fn)
        else launch_check(exercise, fn, nproc, ex, out, timeout_s, progress, ex["stall_s"])
    )
    res = _early(exercise, fn, events, failure, out, {**ex, "name": getattr(fn, "__name__", "")}) or verdict(
        events, out
    )
    res.notes = notes
    return res


def _result(exercise, rows, feedback, out, **frames) -> ExerciseResult:
    checks = pd.DataFrame(rows, columns=["check", "passed", "detail"])
    status = "passed" if bool(checks["passed"].all()) and not feedback else "failed"
    return ExerciseResult(exercise, status, feedback, checks, run_dir=out, **frames)


# ---- the comm hook --------------------------------------------------------------------------------------
def check_comm_hook(
    hook,
    nproc: int = 2,
    steps: int = 4,
    *,
    out=None,
    timeout_s: float = 180.0,
    stall_s: float = STALL_S,
    progress: bool = False,
    verbose: bool = True,
    **params,
) -> ExerciseResult:
    """Train a float64 MLP under DDP with `hook` as its comm hook on `nproc` gloo ranks (different data per
    rank) and compare it after every step with one process trained on the union of the ranks' batches.
    timeout_s bounds the whole check; stall_s (seconds) is how long started ranks may record nothing before
    the check reports a hang."""
    ex = {**HOOK_DEFAULTS, **params, "steps": steps, "stall_s": stall_s, "nproc": nproc}
    res = _check(
        "comm_hook",
        hook,
        nproc,
        ex,
        out,
        timeout_s,
        progress,
        lambda events, out: _hook_verdict(events, nproc, steps, ex, out),
    )
    if verbose:
        print(res.verdict())
    return res


def _hook_verdict(events, nproc, steps, ex, out) -> ExerciseResult:
    st = pd.DataFrame(events.get("hook_step", []))
    bk = pd.DataFrame(events.get("bucket", []))
    per_step = (
        st.groupby("step")
        .agg(
            max_abs_err=("max_abs_err", "max"),
            allclose=("allclose", "all"),
            ratio=("ratio", "median"),
            local=("is_local", "all"),
        )
        .reset_index()
    )
    feedback, bad = [], per_step[~per_step["allclose"]]
    if len(bad):
        s = bad.iloc[0]
        params = sorted({p for ps in st.query("step == @s.step")["bad_params"] for p in ps})
        where = f"step {int(s.step)}: parameters differ from the single-process reference by up to {s.max_abs_err:.2e}"
        r = s.ratio
        if bool(s.local):
            feedback.append(
                f"{where}; the gradients are each rank's own, never combined: did your hook return the "
                f"bucket without all-reducing it?"
            )
        elif r is not None and abs(r - nproc) < 0.05 * nproc:
            feedback.append(
                f"{where}: the gradients are {r:.2f}x the reference: did you sum instead of average "
                f"(divide the bucket by the world size)?"
            )
        elif r is not None and abs(r - 1 / nproc) < 0.05 / nproc:
            feedback.append(
                f"{where}: the gradients are {r:.2f}x the reference: did you divide by the world size twice?"
            )
        else:
            missed = sorted(
                {int(b) for b, ps in zip(bk.get("bucket", []), bk.get("params", [])) if set(ps) & set(params)}
            )
            feedback.append(
                f"{where} (gradient ratio {r if r is None else round(r, 3)}); wrong parameters: "
                f"{', '.join(params)} (bucket(s) {missed}): is every bucket all-reduced and averaged?"
            )
    done = bk["t_end"].notna().all() if "t_end" in bk else False
    rows = [
        (
            "allclose after every step",
            not len(bad),
            f"{int(per_step['allclose'].sum())} of {steps} steps match (rtol {ex['rtol']:g}, atol {ex['atol']:g}); "
            f"max abs error {per_step['max_abs_err'].max():.2e}",
        ),
        (
            "buckets completed",
            bool(done) and len(bk) > 0,
            f"{len(bk)} bucket all-reduces recorded over {nproc} ranks x {steps} steps, "
            f"{bk['bucket'].nunique() if len(bk) else 0} distinct buckets",
        ),
    ]
    if len(bk):
        # when backward returned on that rank (s from the step start, like t_ready/t_start/t_end)
        ends = st.set_index(["rank", "step"])["t_bwd"] if "t_bwd" in st else None
        bk = bk.drop(columns=["kind"]).assign(
            t_backward_end=[
                float(ends.loc[(r, s)]) if ends is not None and (r, s) in ends.index else float("nan")
                for r, s in zip(bk["rank"], bk["step"])
            ]
        )
    return _result("comm_hook", rows, feedback, out, per_step=per_step, buckets=bk)


# ---- the ring all-reduce --------------------------------------------------------------------------------
def check_ring_allreduce(
    ring,
    nproc: int = 2,
    sizes=RING_SIZES,
    *,
    timing_sizes=RING_TIMING_SIZES,
    profile=None,
    out=None,
    timeout_s: float = 180.0,
    stall_s: float = STALL_S,
    progress: bool = False,
    verbose: bool = True,
    **params,
) -> ExerciseResult:
    """Check `ring(tensor)` (an in-place sum over all ranks, like dist.all_reduce) against dist.all_reduce on
    `sizes` (elements, each >= nproc), count its send/recv calls, and time it on `timing_sizes` (bytes) next to
    dist.all_reduce and, given a `profile` (dtlab.Profile or its directory), the ring model
    2(p-1) alpha + 2(p-1)/p n beta with that profile's all-reduce alpha and beta. timeout_s and stall_s
    (seconds) as for :func:`check_comm_hook`."""
    if any(int(n) < nproc for n in sizes):
        raise ValueError(f"sizes must be >= nproc ({nproc}) elements each, got {list(sizes)}")
    ex = {
        **RING_DEFAULTS,
        **params,
        "sizes": [int(n) for n in sizes],
        "stall_s": stall_s,
        "nproc": nproc,
        "timing_sizes": [-(-int(b) // (4 * nproc)) * 4 * nproc for b in timing_sizes],
    }
    res = _check(
        "ring_allreduce",
        ring,
        nproc,
        ex,
        out,
        timeout_s,
        progress,
        lambda events, out: _ring_verdict(events, nproc, ex, profile, out),
    )
    if verbose:
        print(res.verdict())
        if res.timings is not None and len(res.timings):
            print(res.timings.round(3).to_string(index=False))
    return res


def _ring_verdict(events, p, ex, profile, out) -> ExerciseResult:
    sz = pd.DataFrame(events.get("ring_size", []))
    sz["sends"] = [c.get("send", 0) + c.get("isend", 0) for c in sz["calls"]]
    sz["collectives"] = [sorted(k for k in c if k not in ("send", "recv", "isend", "irecv")) for c in sz["calls"]]
    per_size = (
        sz.groupby("n")
        .agg(
            ok=("ok", "all"),
            max_abs_err=("max_abs_err", "max"),
            sends=("sends", "max"),
            sent_bytes=("sent_bytes", "max"),
        )
        .reset_index()
    )
    feedback = []
    for row in sz[~sz["ok"]].itertuples():
        if row.shape != [row.n]:
            feedback.append(f"ring, n={row.n:,}: rank {row.rank} returned shape {row.shape}, expected [{row.n}]")
        else:
            bad = [f"chunk {k} {s}" for k, s in enumerate(row.chunks) if s != "ok"]
            feedback.append(
                f"ring, n={row.n:,} elements, rank {row.rank} (chunks numbered 0..{p - 1}, as "
                f"tensor_split and the formulas count them): {'; '.join(bad) or 'values differ'}"
                + (" (still this rank's own input)" if any("never" in b for b in bad) else "")
            )
        break  # the first failure names the problem; the table has the rest
    used = sorted({c for cs in sz["collectives"] for c in cs})
    if used:
        feedback.append(f"ring: your function called dist.{', dist.'.join(used)}: build it from send/recv only")
    want = 2 * (p - 1)
    if per_size["sends"].max() != want or per_size["sends"].min() != want:
        lo, hi = per_size["sends"].min(), per_size["sends"].max()
        feedback.append(
            f"ring: {lo if lo == hi else f'{lo}..{hi}'} send(s) per rank and call; a ring "
            f"takes 2(p-1) = {want}: p-1 to reduce-scatter, p-1 to all-gather"
        )
    rows = [
        (
            "matches dist.all_reduce",
            bool(per_size["ok"].all()),
            f"{int(per_size['ok'].sum())} of {len(per_size)} sizes ({', '.join(f'{n:,}' for n in per_size['n'])} "
            f"elements; rtol {ex['rtol']:g}, atol {ex['atol']:g})",
        ),
        ("only point-to-point calls", not used, "no collective called" if not used else ", ".join(used)),
        (
            f"2(p-1) = {want} sends per rank",
            not any("sends per rank" in f for f in feedback),
            f"{per_size['sends'].max()} sends, {per_size['sent_bytes'].max():,} bytes at n={per_size['n'].max():,}",
        ),
    ]
    return _result(
        "ring_allreduce",
        rows,
        feedback,
        out,
        per_size=per_size,
        timings=ring_timings(events.get("ring_time", []), p, profile),
    )


def ring_timings(samples, nproc: int, profile=None) -> pd.DataFrame:
    """Median over iterations of the slowest rank, in ms, per size: the student's ring, dist.all_reduce, and
    (with a profile) the ring model 2(p-1) alpha + 2(p-1)/p n beta from the profile's all-reduce fit."""
    t = pd.DataFrame(samples)
    if t.empty:
        return t
    slow = t.groupby(["what", "nbytes", "iter"])["seconds"].max().groupby(["what", "nbytes"]).median().unstack(0)
    out = pd.DataFrame(
        {"nbytes": slow.index, "ring_ms": slow["ring"].values * 1e3, "all_reduce_ms": slow["all_reduce"].values * 1e3}
    )
    if profile is not None:
        prof = profile if isinstance(profile, Profile) else load_profile(profile)
        fit = prof.fits["all_reduce"]
        if fit.form != "ring":
            fit = Profile.from_samples(prof.samples, form="ring").fits["all_reduce"]
        out["model_ms"] = [ring_allreduce(fit.alpha, fit.beta, n, nproc) * 1e3 for n in out["nbytes"]]
        out["ring/model"] = out["ring_ms"] / out["model_ms"]
    return out
