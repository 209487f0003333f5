"""Lab 5 (shrinking communication): fp16's bytes on the wire, PowerSGD's r, all-reduce rounds per micro-batch with
accumulation, which term of the ring model compression shrinks."""

from __future__ import annotations

from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key
from dtlab.model import costmodel
from dtlab.model.compression import lever_table

LAB = "05_shrinking_comm"
K = 4  # micro-batches per optimizer step in the lab's accumulation run
LABELS = ("none", "fp16", "powersgd r=1", f"accumulate {K}")


def configs(cfg) -> dict:
    """The lab's four runs of `cfg` (lab_config()), by the labels the lab gives them."""
    return dict(
        zip(
            LABELS,
            (
                cfg,
                cfg.replace(comm_hook="fp16"),
                cfg.replace(comm_hook="powersgd", powersgd_rank=1, powersgd_start_iter=2),
                cfg.replace(accumulate=K),
            ),
        )
    )


def sources(rec) -> dict:
    """The four lever runs, from one seed."""
    return {
        "runs": lambda: {label: rec.run(c, f"lab 5's {label!r} run") for label, c in configs(rec.lab_config()).items()}
    }


def _table(runs):
    missing = [k for k in LABELS if k not in runs]
    if missing:
        raise ValueError(f"runs: lab 5's checks need the runs labelled {list(LABELS)}; missing {missing}")
    return lever_table({k: runs[k] for k in LABELS}).set_index("label")


def _fp16(runs) -> Key:
    t = _table(runs)
    return Key(
        "lab05.q1",
        "number",
        float(t.loc["fp16", "wire_bytes"]),
        points=2,
        rel_tol=0.01,
        unit="B",
        tol_source="exact byte counts (the median rank-step of the fp16 run); 1% allows rounding",
        hint="fp16_compress_hook casts each fp32 bucket to 16 bits",
        ratio_hints={
            2.0: "that is the gradient bytes: the hook sends 16-bit values",
            0.5: "you halved twice: fp32 (4 B) to fp16 (2 B) is one halving",
        },
    )


def _powersgd(runs) -> Key:
    r = float(_table(runs).loc["powersgd r=1", "ratio"])
    return Key(
        "lab05.q2",
        "number",
        r,
        points=2,
        rel_tol=0.05,
        tol_source="exact byte counts of the compressed steps; 5% allows a rounded hand calculation",
        hint="sum over tensors: (n + m') x 1 for matrices where that is at least 2x smaller than n m', n m' for "
        "the rest (biases, LayerNorm); times 4 B; divide by grad_bytes",
        ratio_hints={1 / r**2: "you gave 1/r: r is bytes on the wire / gradient bytes"},
    )


def _rounds(runs) -> Key:
    t = _table(runs)
    frac = float(t.loc[f"accumulate {K}", "rounds_per_micro_batch"] / t.loc["none", "rounds_per_micro_batch"])
    return Key(
        "lab05.q3",
        "number",
        frac,
        abs_tol=0.01,
        tol_source="exact bucket counts; 0.01 allows a rounded fraction",
        hint=f"no_sync() skips the all-reduce on K - 1 of every K micro-batches (K = {K})",
    )


def _term(*_) -> Key:
    n, p, r, alpha, beta = 1e8, 8, 0.5, 1e-5, 1e-9  # any positive alpha, beta, n: the form decides
    lat_same = costmodel.ring_allreduce(alpha, 0.0, r * n, p) == costmodel.ring_allreduce(alpha, 0.0, n, p)
    bw_same = costmodel.ring_allreduce(0.0, beta, r * n, p) == costmodel.ring_allreduce(0.0, beta, n, p)
    term = {(True, False): "bandwidth (beta)", (False, True): "latency (alpha)", (False, False): "both"}[
        (bool(lat_same), bool(bw_same))
    ]
    return Key(
        "lab05.q4",
        "choice",
        term,
        choices=("latency (alpha)", "bandwidth (beta)", "both"),
        explanation="costmodel.ring_allreduce with beta = 0 does not change when n becomes r n; with alpha = 0 it does",
        hint="evaluate 2(p-1) alpha + 2(p-1)/p r n beta twice: once with beta = 0, once with alpha = 0",
    )


QUESTIONS = (
    Question("lab05.q1", 2, "my_fp16_wire_bytes", ("runs",), _fp16),
    Question("lab05.q2", 2, "my_powersgd_ratio", ("runs",), _powersgd),
    Question("lab05.q3", 1, "my_rounds_fraction", ("runs",), _rounds),
    Question("lab05.q4", 1, "my_term", (), _term),
)
