"""The claims labs 5 to 8 print, each built from the runs on screen (dtlab.course.claims); the ones about noisy
measurements themselves (labs 0, 1 and 7, and the note on a poor fit) are in dtlab.course.noise_claims, lab 10's
about tensor and pipeline parallelism in dtlab.course.parallel_claims; both are re-exported here, so a lab imports
this one module.

One function per statement a lab makes about an outcome. Each takes what the lab measured, computes the
model's expectation it names, and, when this machine disagrees, gives the reason with the measurement that
shows it (the wait for the peer inside T_comm, the cost of an fp16 cast, the spread of a noisy step, ...).
The functions only read runs and profiles; the lab decides what to run.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtlab.course.claims import compare, spread
from dtlab.units import fmt_ratio, fmt_time


def step_wait(run) -> float:
    """Median over the measured steps of the longest wait of any rank for a peer to join its all-reduce (s):
    the part of T_comm that is waiting, not transfer (dtlab.results.stragglers)."""
    from dtlab.results.stragglers import run_waits

    w = run_waits(run)
    return float(w.groupby("step")["wait_s"].max().median()) if len(w) else 0.0


def _num(x: float) -> str:
    """Three significant digits, never in exponent notation (a table cell): 0.0123, 45.2, 5,654."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def timed_medians(timed: dict) -> pd.DataFrame:
    """One row per configuration of interleaved runs (label -> list of runs): `runs`, and the median over
    them of t_step, t_comp, t_comm (s per step), t_step_per_sample, t_comm_per_sample (s per sample) and wait
    (the wait inside T_comm, s per step, :func:`step_wait`), each with its smallest and largest run
    (columns ..._lo, ..._hi)."""
    from dtlab.model.compression import comm_per_sample

    rows = []
    for label, runs in timed.items():
        per = [dict(comm_per_sample(r), wait=step_wait(r)) for r in runs]
        row = {"label": label, "runs": len(runs)}
        for key in ("t_step", "t_comp", "t_comm", "t_step_per_sample", "t_comm_per_sample", "wait"):
            s = spread([p[key] for p in per])
            row.update({key: s.median, f"{key}_lo": s.lo, f"{key}_hi": s.hi})
        rows.append(row)
    return pd.DataFrame(rows)


def runs_table(medians: pd.DataFrame) -> pd.DataFrame:
    """:func:`timed_medians` for the screen: medians in ms (µs per sample) with their range, units in the
    column names. T_comp is left out: from a run's 2 baseline steps it is too noisy to set beside T_step."""
    out = pd.DataFrame({"configuration": medians["label"], "runs": medians["runs"]})
    for key, name, scale in (
        ("t_step", "T_step (ms)", 1e3),
        ("t_comm", "T_comm (ms)", 1e3),
        ("wait", "of it waiting (ms)", 1e3),
        ("t_comm_per_sample", "T_comm per sample (µs)", 1e6),
    ):
        out[name] = (medians[key] * scale).round(3)
        out[name.replace(" (", " range (")] = [
            f"{_num(lo * scale)} .. {_num(hi * scale)}" for lo, hi in zip(medians[f"{key}_lo"], medians[f"{key}_hi"])
        ]
    return out


def _per(timed, label, key):
    from dtlab.model.compression import comm_per_sample

    return [comm_per_sample(r)[key] for r in timed[label]]


def _transfer(run, per_sample: bool) -> float:
    """A run's median T_comm per step less the wait for a peer inside it (:func:`step_wait`): the transfer alone,
    per step or per sample (s)."""
    from dtlab.model.compression import comm_per_sample

    c = comm_per_sample(run)
    moving = max(c["t_comm"] - step_wait(run), 0.0)
    return moving / c["samples_per_step"] if per_sample else moving


def contention_claim(pred: pd.DataFrame, how: str):
    """'During training an all-reduce takes longer than in isolation: it shares the machine with backward compute',
    from dtlab.predict rows of a loaded profile: the measured T_comm of each step beside the contended replay (the
    loaded fit while backward runs, the idle fit after), with the idle replay's ratio for the gap contention
    closes."""
    rows = pred.dropna(subset=["contended_t_comm"])
    measured, contended, idle = (rows[c].tolist() for c in ("measured_t_comm", "contended_t_comm", "predicted_t_comm"))
    gap = spread([m / i for m, i in zip(measured, idle) if i])

    def why(result):
        return (
            f"with every bucket at its idle price the replay's T_comm is ×{1 / gap.median:.3g} of the measured; "
            "priced under load it is the ratio above. What is left is what the loaded calibration does not "
            "reproduce: its load is one backward pass replayed on every rank, while in training the ranks also "
            "wait for each other (a rank that starts an all-reduce first counts its wait) and compute slows "
            "down in turn while gloo's threads run."
        )

    return compare(
        "lab03.contention",
        "during training an all-reduce takes longer than alone: it shares the cores "
        "(on a GPU, the SMs) with backward compute, as the loaded calibration measured",
        "T_comm per step",
        ("measured", measured),
        ("contended replay", contended),
        expected=1.0,
        model="the replay with each bucket priced by the loaded fit while backward runs, the idle fit "
        f"after; the idle replay is ×{gap.median:.3g} (range ×{gap.lo:.3g} .. ×{gap.hi:.3g}) "
        "below the measurement",
        rel_tol=0.3,
        why=why,
        how=how,
        per="step",
    )


def accumulation_claim(timed: dict, k: int, how: str, reference: str = "none"):
    """'Accumulating K micro-batches cuts the transfer time per sample by K' against interleaved runs: T_comm less
    the wait for the other rank (what the model prices), per sample."""
    acc = f"accumulate {k}"
    comm = {x: spread(_per(timed, x, "t_comm")) for x in (reference, acc)}
    comp = {x: spread(_per(timed, x, "t_comp")) for x in (reference, acc)}
    wait = {x: spread([step_wait(r) for r in timed[x]]) for x in (reference, acc)}

    def why(result):
        text = ""
        if result == "inconclusive":
            text = (
                f"the {len(timed[acc])} runs disagree with each other (the range above): a run's median over a "
                "few steps on shared cores moves by tens of percent. "
            )
        text += (
            f"One all-reduce round of the same bytes per step should leave T_comm per step unchanged; it went "
            f"from {fmt_time(comm[reference].median)} to {fmt_time(comm[acc].median)}. "
        )
        if wait[acc].median > wait[reference].median:
            text += (
                f"Waiting for the other rank to join took {fmt_time(wait[acc].median)} of it per step, "
                f"against {fmt_time(wait[reference].median)} (dtlab.results.stragglers): over K micro-batches the two ranks' "
                "compute drifts apart before they meet, and the rank that arrives first counts its wait as "
                "T_comm."
            )
            grew, waited = comm[acc].median - comm[reference].median, wait[acc].median - wait[reference].median
            if grew > waited:
                text += (
                    f" The rest of the growth ({fmt_time(grew - waited)}) is transfer, which here shares the "
                    f"cores with K backward passes per step (T_comp {fmt_time(comp[acc].median)} against "
                    f"{fmt_time(comp[reference].median)})."
                )
            return text
        return text + (
            f"The wait for the other rank did not grow ({fmt_time(wait[acc].median)} against "
            f"{fmt_time(wait[reference].median)}); the rest is transfer, which here shares the cores with "
            f"K backward passes per step (T_comp {fmt_time(comp[acc].median)} against "
            f"{fmt_time(comp[reference].median)})."
        )

    return compare(
        "lab05.accumulate",
        f"accumulating K = {k} micro-batches per step cuts the transfer time per sample by K",
        "transfer time per sample (T_comm less the wait for the other rank)",
        (acc, [_transfer(r, True) for r in timed[acc]]),
        (reference, [_transfer(r, True) for r in timed[reference]]),
        expected=1 / k,
        model="the same all-reduce rounds per step, K times the samples; the model prices the transfer, "
        "so the wait for a peer is left out of the measurement too",
        rel_tol=0.3,
        why=why,
        how=how,
    )


def fp16_bytes_claim(table: pd.DataFrame):
    """'fp16 halves the bytes on the wire', from the bucket records (exact counts)."""
    t = table.set_index("label")
    return compare(
        "lab05.fp16_bytes",
        "the fp16 hook halves the bytes on the wire",
        "bytes on the wire per rank-step",
        ("fp16", [t.loc["fp16", "wire_bytes"]]),
        ("none", [t.loc["none", "wire_bytes"]]),
        expected=0.5,
        model="2 of every 4 bytes of an fp32 gradient",
        unit="B",
        rel_tol=0.01,
        per="run",
        how="byte counts are exact",
    )


def _seconds_per_wire_byte(run) -> float:
    b = run.buckets[run.buckets["step"] >= run.warmup]
    return float(((b["t_end"] - b["t_start"]) / b["wire_bytes"].replace(0, np.nan)).median())


def fp16_time_claim(timed: dict, profile, how: str):
    """'fp16 shortens the transfer (its bandwidth term halves)', with the model's ratio from the profile: T_comm
    less the wait for the other rank per step, against the model's T_comm (which prices the transfer only)."""
    from dtlab.model.compression import compression_from_run
    from dtlab.model.prediction import predict

    pred = {k: float(predict(timed[k][0], profile)["predicted_t_comm"].median()) for k in ("fp16", "none")}
    encode = spread([compression_from_run(r)["encode_s"] for r in timed["fp16"]])
    per_byte = {k: spread([_seconds_per_wire_byte(r) for r in timed[k]]).median for k in ("fp16", "none")}

    def why(result):
        text = (
            f"the model prices only the transfer. The fp16 hook first casts each bucket to 16 bits: "
            f"{fmt_time(encode.median)} per step here, on the same cores as backward (t_start - t_ready). "
        )
        slower = per_byte["fp16"] / per_byte["none"]
        if slower > 1:
            text += (
                f"Per byte on the wire its all-reduces took {fmt_ratio(slower)} as long as the fp32 ones "
                "(t_end - t_start, which includes casting back): gloo adds fp16 values through its float16 "
                "type (gloo/types.h), which converts every element to fp32 and back in software for each "
                "addition, where fp32 additions run on the CPU's vector units. "
            )
        return text + "On a GPU, NCCL adds fp16 values natively and the cast is one small kernel."

    return compare(
        "lab05.fp16_time",
        "the fp16 hook shortens the transfer: it halves the bandwidth term",
        "transfer time per step (T_comm less the wait for the other rank)",
        ("fp16", [_transfer(r, False) for r in timed["fp16"]]),
        ("none", [_transfer(r, False) for r in timed["none"]]),
        expected=pred["fp16"] / pred["none"],
        model="dtlab.predict with this machine's all-reduce fit, each bucket priced on its wire bytes",
        test="below",
        why=why,
        how=how,
    )


def straggler_claim(waits: pd.DataFrame, waiter: int = 0, slow: int = 1):
    """'Rank `waiter` waits about rank `slow`'s injected delay each step' (the synchronous-step model with equal
    compute), paired step by step within one run (dtlab.results.stragglers.run_waits frame)."""
    w = waits.set_index(["step", "rank"])
    steps = sorted(set(waits["step"]))
    wait = [float(w.loc[(s, waiter), "wait_s"]) for s in steps]
    delay = [float(w.loc[(s, slow), "straggle_s"]) for s in steps]
    own = [
        float(w.loc[(s, slow), "t_comp_s"] - w.loc[(s, slow), "straggle_s"] - w.loc[(s, waiter), "t_comp_s"])
        for s in steps
    ]

    def why(result):
        d = spread(own)
        return (
            f"the synchronous-step model says rank {waiter} waits max_j T_comp,j - T_comp,{waiter}: rank {slow}'s "
            f"delay plus the difference of their own compute, which was {fmt_time(d.median)} per step here "
            f"(range {fmt_time(d.lo)} .. {fmt_time(d.hi)}): compute on shared cores varies by tens of percent "
            "from step to step."
        )

    return compare(
        "lab06.straggler_wait",
        f"rank {waiter} waits for rank {slow}'s injected delay every step",
        "time per step",
        (f"rank {waiter}'s wait", wait),
        (f"rank {slow}'s injected delay", delay),
        expected=1.0,
        model="synchronous steps with equal compute: wait = the delay",
        rel_tol=0.5,
        why=why,
        per="step",
        how=f"pairs of the same step of one run ({len(steps)} steps)",
    )


def ps_ring_claim(timed: dict, forms: pd.DataFrame, samples: pd.DataFrame, how: str, ring: str, ps: str):
    """'The parameter server is slower than the ring at p = 2' (T_comm of interleaved runs) against the
    forms' ratio, with the calibrated collectives alone as the evidence when it does not hold."""
    expect = float(forms.set_index("nproc").loc[2, "ps_over_ring_gloo"])
    med = samples[samples["nproc"] == 2].groupby(["op", "nbytes"])["seconds"].median()
    ratio = (med["ps"] / med["all_reduce"]).dropna()
    comm = {k: [r.per_step()["t_comm"].median() for r in timed[k]] for k in (ring, ps)}

    def why(result):
        alone = ", ".join(f"{fmt_ratio(r)} at {int(n):,} B" for n, r in ratio.items())
        rs, ps_ = spread(comm[ring]), spread(comm[ps])
        if result == "inconclusive":
            head = (
                f"the runs disagree with each other: {ring} T_comm {fmt_time(rs.lo)} .. {fmt_time(rs.hi)}, {ps} "
                f"{fmt_time(ps_.lo)} .. {fmt_time(ps_.hi)}. In training, T_comm is time in flight beside "
                "backward on the shared cores, waits for the other rank included, and it scatters more than "
                "the difference the forms predict."
            )
        else:
            head = (
                f"in every run the parameter server's T_comm was below the ring's ({fmt_time(ps_.median)} "
                f"against {fmt_time(rs.median)}). In training the buckets are all-reduced beside backward on "
                "the shared cores and wait for the other rank; which of these favoured the server here is not "
                "separated by this lab."
            )
        return head + f" The collectives alone at p = 2 (the calibration above) gave PS / ring = {alone}."

    return compare(
        "lab06.ps_vs_ring",
        "a parameter server is slower than the ring all-reduce",
        "T_comm per step",
        (ps, comm[ps]),
        (ring, comm[ring]),
        expected=expect,
        model="gloo's reduce + broadcast over its ring all-reduce at p = 2 (dtlab.model.ps), "
        "with this machine's all-reduce fit",
        test="above",
        why=why,
        how=how,
    )


def levels_claim(intra, inter, link: str, min_bytes: int = 4 * 2**20):
    """'Between nodes is slower than inside a node' from the two calibrations, size by size, at the sizes
    (>= min_bytes) where the bandwidth term dominates."""
    a = inter.samples.groupby("nbytes")["seconds"].median()
    b = intra.samples.groupby("nbytes")["seconds"].median()
    common = [n for n in a.index if n in b.index]
    sizes = [n for n in common if n >= min_bytes] or common[-3:]
    shaped = "shaped" in link

    def why(result):
        if not shaped:
            return (
                "no shaped link here: both levels are loopback TCP on the same cores (the lab said so at the "
                "top), so the 'network' is as fast as a copy inside the machine."
            )
        odd = [n for n in sizes if a[n] <= b[n]]
        return (
            f"the link is {link}, but at {', '.join(f'{n:,} B' for n in odd) or 'some sizes'} the all-reduce "
            "inside a node measured as slow as between nodes: the two emulated nodes share this machine's "
            "cores, and a calibration call that waits for a core scatters (compare its neighbours in the "
            "table above)."
        )

    return compare(
        "lab07.levels",
        "the all-reduce between nodes is slower than inside a node",
        "all-reduce time",
        ("between nodes", [a[n] for n in sizes]),
        ("inside a node", [b[n] for n in sizes]),
        expected=None,
        model=f"the inter-node link ({link}) against copies inside one machine",
        test="above",
        why=why,
        per="size",
        how=f"sizes {sizes[0]:,} .. {sizes[-1]:,} B, paired by size",
    )


def ring_claim(timings: pd.DataFrame, rel_rms: float):
    """'Your ring takes about as long as dist.all_reduce' (both are 2(p-1)-step rings to the model), size by
    size from the exercise's timings (ms)."""

    def why(result):
        faster = "faster" if timings["ring_ms"].median() < timings["all_reduce_ms"].median() else "slower"
        return (
            f"the model prices both as the same 2(p-1) messages and 2(p-1)/p n bytes; it has no term for how a "
            f"call is made. Here your ring was {faster}: dist.all_reduce on gloo hands the work to "
            "ProcessGroupGloo's worker threads and runs gloo's own ring implementation, your ring calls "
            "send/recv from Python. Which of these costs dominates is not measured here (question 5); the "
            f"alpha-beta fit itself missed its own samples by {rel_rms:.0%} (relative RMS)."
        )

    return compare(
        "lab08.ring_vs_all_reduce",
        "your ring takes about as long as dist.all_reduce",
        "time per call (slowest rank, median over iterations)",
        ("your ring", list(timings["ring_ms"] / 1e3)),
        ("dist.all_reduce", list(timings["all_reduce_ms"] / 1e3)),
        expected=1.0,
        model="both are rings of 2(p-1) steps: 2(p-1) alpha + 2(p-1)/p n beta",
        rel_tol=0.5,
        why=why,
        per="size",
        how="paired by size",
    )


# claims about noisy measurements themselves, in their own module (re-exported for the labs)
from dtlab.course.noise_claims import backward_claim, exposed_claim, fit_note, smoke_claim  # noqa: E402,F401
from dtlab.course.parallel_claims import bubble_falls_claim, bubble_theory_claim, tp_count_claim  # noqa: E402,F401
