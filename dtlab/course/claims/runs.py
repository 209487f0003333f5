"""The runs claims compare, and the tables labs 5 and 6 show of them.

Runs for a comparison come from :func:`interleaved`: configurations in the order A B C, then C B A, ..., so a
drift in the machine (a cold first launch, a neighbour's load) does not land on one configuration
(:func:`order_text` says so in a claim's `how`). :func:`timed_medians` and :func:`runs_table` summarise them, with
the wait for a peer inside T_comm (:func:`step_wait`), which the model does not price (:func:`transfer` leaves it
out). Pure apart from :func:`interleaved`, which launches through the `run` function it is given.
"""

from __future__ import annotations

import pandas as pd

from dtlab.course.claims import spread
from dtlab.model.compression import comm_per_sample
from dtlab.results.stragglers import run_waits


def interleaved(configs: dict, repeats: int, run) -> dict:
    """Run every configuration `repeats` times, interleaved: A B C, C B A, A B C, ... (a drift of the machine
    spreads over all of them). configs: label -> RunConfig; run: the function that runs one (dtlab.run).
    Returns label -> list of runs, in repeat order, so run i of one label was made next to run i of another."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    labels = list(configs)
    out = {k: [] for k in labels}
    for i in range(repeats):
        for k in labels if i % 2 == 0 else labels[::-1]:
            out[k].append(run(configs[k]))
    return out


def order_text(labels, repeats: int) -> str:
    """'interleaved: A B, then B A' for the order :func:`interleaved` used."""
    if repeats == 1:
        return "one run each, in the order " + " ".join(labels)
    rounds = [" ".join(labels if i % 2 == 0 else labels[::-1]) for i in range(repeats)]
    return "interleaved: " + ", then ".join(rounds)


def step_wait(run) -> float:
    """Median over the measured steps of the longest wait of any rank for a peer to join its all-reduce (s):
    the part of T_comm that is waiting, not transfer (dtlab.results.stragglers)."""
    w = run_waits(run)
    return float(w.groupby("step")["wait_s"].max().median()) if len(w) else 0.0


def transfer(run, per_sample: bool) -> float:
    """A run's median T_comm per step less the wait for a peer inside it (:func:`step_wait`): the transfer alone,
    per step or per sample (s)."""
    c = comm_per_sample(run)
    moving = max(c["t_comm"] - step_wait(run), 0.0)
    return moving / c["samples_per_step"] if per_sample else moving


def per_run(runs: list, key: str) -> list:
    """One figure of dtlab.model.compression.comm_per_sample (t_comm, t_comp, ...) for each run."""
    return [comm_per_sample(r)[key] for r in runs]


def _num(x: float) -> str:
    """Three significant digits, never in exponent notation (a table cell): 0.0123, 45.2, 5,654."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def timed_medians(timed: dict) -> pd.DataFrame:
    """One row per configuration of interleaved runs (label -> list of runs): `runs`, and the median over
    them of t_step, t_comp, t_comm (s per step), t_step_per_sample, t_comm_per_sample (s per sample) and wait
    (the wait inside T_comm, s per step, :func:`step_wait`), each with its smallest and largest run
    (columns ..._lo, ..._hi)."""
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
