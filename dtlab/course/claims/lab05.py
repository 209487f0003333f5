"""The claims lab 5 prints about shrinking communication (dtlab.course.claims), each from the interleaved runs on
screen (dtlab.course.claims.runs): fp16 halves the bytes on the wire, fp16 shortens the transfer, and accumulating
K micro-batches cuts the transfer time per sample by K. Where this machine disagrees, the reason comes with the
measurement that shows it: the wait for the other rank inside T_comm, the cost of an fp16 cast, gloo's software
fp16 additions.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtlab.course.claims import compare, spread
from dtlab.course.claims.runs import per_run, step_wait, transfer
from dtlab.model.compression import compression_from_run
from dtlab.model.prediction import predict
from dtlab.units import fmt_ratio, fmt_time


def accumulation_claim(timed: dict, k: int, how: str, reference: str = "none"):
    """'Accumulating K micro-batches cuts the transfer time per sample by K' against interleaved runs: T_comm less
    the wait for the other rank (what the model prices), per sample."""
    acc = f"accumulate {k}"
    comm = {x: spread(per_run(timed[x], "t_comm")) for x in (reference, acc)}
    comp = {x: spread(per_run(timed[x], "t_comp")) for x in (reference, acc)}
    wait = {x: spread([step_wait(r) for r in timed[x]]) for x in (reference, acc)}

    def why(outcome):
        text = ""
        if outcome == "inconclusive":
            text = (
                f"the {len(timed[acc])} runs disagree with each other (the range above): a run's median over a "
                "few steps on shared cores moves by tens of percent. "
            )
        text += (
            f"One all-reduce round of the same bytes per step should leave T_comm per step unchanged; it went "
            f"from {fmt_time(comm[reference].median)} to {fmt_time(comm[acc].median)}. "
        )
        shared = (
            f"which here shares the cores with K backward passes per step (T_comp {fmt_time(comp[acc].median)} "
            f"against {fmt_time(comp[reference].median)})."
        )
        if wait[acc].median > wait[reference].median:
            text += (
                f"Waiting for the other rank to join took {fmt_time(wait[acc].median)} of it per step, against "
                f"{fmt_time(wait[reference].median)} (dtlab.results.stragglers): over K micro-batches the two "
                "ranks' compute drifts apart before they meet, and the rank that arrives first counts its wait as "
                "T_comm."
            )
            grew, waited = comm[acc].median - comm[reference].median, wait[acc].median - wait[reference].median
            if grew > waited:
                text += f" The rest of the growth ({fmt_time(grew - waited)}) is transfer, " + shared
            return text
        return text + (
            f"The wait for the other rank did not grow ({fmt_time(wait[acc].median)} against "
            f"{fmt_time(wait[reference].median)}); the rest is transfer, " + shared
        )

    return compare(
        "lab05.accumulate",
        f"accumulating K = {k} micro-batches per step cuts the transfer time per sample by K",
        "transfer time per sample (T_comm less the wait for the other rank)",
        (acc, [transfer(r, True) for r in timed[acc]]),
        (reference, [transfer(r, True) for r in timed[reference]]),
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
    pred = {k: float(predict(timed[k][0], profile)["predicted_t_comm"].median()) for k in ("fp16", "none")}
    encode = spread([compression_from_run(r)["encode_s"] for r in timed["fp16"]])
    per_byte = {k: spread([_seconds_per_wire_byte(r) for r in timed[k]]).median for k in ("fp16", "none")}

    def why(outcome):
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
        ("fp16", [transfer(r, False) for r in timed["fp16"]]),
        ("none", [transfer(r, False) for r in timed["none"]]),
        expected=pred["fp16"] / pred["none"],
        model="dtlab.predict with this machine's all-reduce fit, each bucket priced on its wire bytes",
        test="below",
        why=why,
        how=how,
    )
