"""Lab 1 (DDP breakdown): gradient bytes per rank-step, buckets per step, the bucket whose all-reduce is exposed."""

from __future__ import annotations

import math

from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key
from dtlab.model.whatif import model_param_nbytes

LAB = "01_ddp_breakdown"


def sources(rec) -> dict:
    """The lab's one DDP run: `lab_config()`."""
    return {"run": lambda: rec.run(rec.lab_config(), "lab 1's DDP run (lab_config())")}


def grad_bytes(run) -> int:
    """fp32 gradient bytes per rank and step, from the architecture of the run's model (not from its records)."""
    return int(sum(model_param_nbytes(run.config.model)))


def _steady(run):
    b = run.buckets
    if b.empty:
        raise ValueError(f"{run.path}: the run recorded no buckets")
    steady = b[b["step"] == b["step"].max()]
    return steady[steady["rank"] == 0]


def _bytes(run) -> Key:
    hints = {
        0.25: "you counted parameters, or each gradient as one unit: DDP all-reduces 4-byte fp32 gradients, "
        "so multiply the parameter count by 4",
        0.5: "2 bytes per gradient is fp16/bf16; this run trains in fp32: 4 bytes per gradient",
        2.0: "you counted twice: each rank all-reduces each gradient once per step, and nbytes is the tensor "
        "(nccl-tests' convention), not send plus receive nor all ranks together",
    }
    if run.nproc != 2:
        hints[float(run.nproc)] = "that is all ranks together; the question asks per rank"
    return Key(
        "lab01.q1",
        "number",
        grad_bytes(run),
        points=2,
        rel_tol=0.01,
        unit="B",
        ratio_hints=hints,
        tol_source="exact byte counts (every rank-step all-reduces the same bytes); 1% allows rounding",
        hint="DDP all-reduces every gradient once per step, 4 bytes (fp32) per parameter",
    )


def _buckets(run) -> Key:
    s0 = _steady(run)
    largest = max(run.resolved["param_nbytes"])
    rule = math.ceil(grad_bytes(run) / (float(run.config.ddp.bucket_mb) * 2**20))
    return Key(
        "lab01.q2",
        "number",
        int(len(s0)),
        abs_tol=1,
        unit="buckets",
        tol_source="the bucket count is exact (the same in every steady step); 1 allows an off-by-one at the cap",
        hint=f"ceil(grad_bytes / cap) = {rule} would hold if tensors could be split, but DDP never splits a "
        f"tensor and closes a bucket once it reaches the cap: the largest tensor alone is {largest:,} B "
        "(the word embeddings), in one bucket",
    )


def _unhidden(run) -> Key:
    """Derived, not measured: the bucket that becomes ready last is issued when backward compute has ended, so
    nothing is left to hide its all-reduce (gloo's two threads may finish an earlier, larger bucket later, so which
    all-reduce *ends* last is not the question). The run only illustrates it."""
    s0 = _steady(run)
    last = s0.loc[s0["t_ready"].idxmax()]
    return Key(
        "lab01.q3",
        "choice",
        "last ready",
        choices=("first ready", "last ready"),
        explanation=f"bucket {int(last['bucket'])} became ready last, at {last['t_ready'] * 1e3:.1f} ms from the "
        f"step start, and its all-reduce ended at {last['t_end'] * 1e3:.1f} ms; once the last "
        "bucket is ready no backward compute is left to hide it",
        hint="in the timeline above, find the all-reduce that ends last and ask what compute ran beside it",
    )


QUESTIONS = (
    Question("lab01.q1", 2, "my_bytes_guess", ("run",), _bytes),
    Question("lab01.q2", 1, "my_buckets_guess", ("run",), _buckets),
    Question("lab01.q3", 1, "my_unhidden_bucket", ("run",), _unhidden),
)
