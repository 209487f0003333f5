"""Lab 8 (build it yourself): the student's DDP comm hook and ring all-reduce, run again by the autograder on 2
gloo ranks (dtlab.course.exercises), and three derived predictions (the last: the parameter server beside the
ring)."""

from __future__ import annotations

import os

from dtlab.course.exercises import check_comm_hook, check_ring_allreduce
from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key

LAB = "08_build_it_yourself"
NPROC = 2  # the checks run this many gloo ranks


def sources(rec) -> dict:
    """Nothing recorded: the exercises run again from the student's function, the rest is derived."""
    return {}


def _hook(answer, scratch) -> Key:
    res = check_comm_hook(
        answer,
        nproc=NPROC,
        steps=4,
        verbose=False,
        out=os.path.join(scratch, "exercise-comm_hook") if scratch else None,
    )
    return Key("lab08.hook", "exercise", res, points=4, tol_source="the exercise's own checks")


def _ring(answer, scratch) -> Key:
    res = check_ring_allreduce(
        answer,
        nproc=NPROC,
        timing_sizes=(2**14,),
        verbose=False,
        out=os.path.join(scratch, "exercise-ring_allreduce") if scratch else None,
    )
    return Key("lab08.ring", "exercise", res, points=4, tol_source="the exercise's own checks")


def _factor(*_) -> Key:
    return Key(
        "lab08.q1",
        "number",
        NPROC,
        rel_tol=0.01,
        tol_source="derived: each rank's loss is a mean over its own batch, so a sum of p bucket gradients is "
        "p times their average (exact; 1% for a rounded answer)",
        hint="a sum of p per-rank mean gradients against their average: run your hook without the division "
        "and read the check's ratio",
    )


def _sends(*_) -> Key:
    return Key(
        "lab08.q2",
        "number",
        2 * (NPROC - 1),
        abs_tol=0,
        tol_source="derived: p-1 reduce-scatter steps and p-1 all-gather steps, one send each (exact)",
        hint="count the steps of both phases; each sends one chunk to the right neighbour",
    )


def server_sent(p, n):
    """Bytes rank 0 sends per call as a parameter server (every rank sends it n bytes, it sends the sum back)."""
    return (p - 1) * n


def _bytes(*_) -> Key:
    return Key(
        "lab08.q3",
        "formula",
        server_sent,
        points=2,
        explanation="the sum, n bytes, to each of the p-1 other ranks: it grows with p, the ring's "
        "2(p-1)/p n per rank does not",
        tol_source="exact formula, compared at every point of a grid",
        hint="rank 0 receives from everyone, then sends the whole sum to every other rank",
    )


QUESTIONS = (
    Question("lab08.hook", 4, "my_allreduce_hook", ("answer", "scratch"), _hook),
    Question("lab08.q1", 1, "my_factor_guess", (), _factor),
    Question("lab08.ring", 4, "my_ring_allreduce", ("answer", "scratch"), _ring),
    Question("lab08.q2", 1, "my_sends_guess", (), _sends),
    Question("lab08.q3", 2, "my_bytes_guess", (), _bytes),
)
