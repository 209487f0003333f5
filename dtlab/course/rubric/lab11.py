"""Lab 11 (reading a profiler trace): the exposed communication per step of a real 2-GPU trace shipped with dtlab
(dtlab.public_trace), and where its slowest all-reduce spent its time. Keys come from the shipped trace itself,
read again by the autograder: nothing the student's kernel holds."""

from __future__ import annotations

from dtlab.course.checks import tol_from_spread
from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key
from dtlab.results.kineto import load_trace, public_trace

LAB = "11_reading_a_trace"
TRACE = "hta-2ranks-rank0"
WAITED, MOVED = "waiting for its peer", "moving its bytes"


def sources(rec) -> dict:
    """The lab's trace: the public one dtlab ships (the same for every student)."""
    return {"trace": _trace}


def _trace():
    return load_trace(public_trace(TRACE))


def _exposed(trace) -> Key:
    b = trace.breakdown()
    ms = b["exposed"] * 1e3
    return Key(
        "lab11.q1",
        "number",
        float(ms.median()),
        points=2,
        unit="ms",
        rel_tol=tol_from_spread(ms, floor=0.25),
        tol_source=f"the spread of the exposed time over the trace's {len(ms)} steps (half the min..max range "
        "over the median, at least 25%)",
        hint="the model's T_comm for one step's all-reduces, less what the compute kernels of the step can "
        "hide: read T_comp and T_step of trace.breakdown() before you answer",
    )


def slowest(trace) -> tuple[float, float, float]:
    """(the slowest all-reduce's duration, the median of the all-reduces of the same size, its bytes)."""
    c = trace.collectives
    ar = c[c["op"] == "all_reduce"].assign(d=lambda x: x["t_end"] - x["t_start"])
    top = ar.loc[ar["d"].idxmax()]
    same = ar[ar["nbytes"] == top["nbytes"]]["d"]
    return float(top["d"]), float(same.median()), float(top["nbytes"])


def _where(trace) -> Key:
    d, med, n = slowest(trace)
    right = WAITED if d > 1.5 * med else MOVED
    return Key(
        "lab11.q2",
        "choice",
        right,
        choices=(WAITED, MOVED),
        explanation=f"the slowest all-reduce ({n:,.0f} B) took {d * 1e3:.2f} ms where the same bytes took "
        f"{med * 1e3:.2f} ms (median): the same transfer cannot take that much longer, so the rest "
        "is the wait for the other rank to arrive",
        hint="compare the slowest all-reduce with the other all-reduces of exactly the same size",
    )


QUESTIONS = (
    Question("lab11.q1", 2, "my_exposed_ms", ("trace",), _exposed),
    Question("lab11.q2", 1, "my_slowest_waits", ("trace",), _where),
)
