"""Lab 0 (setup check): the order of magnitude and the time of a 1 MiB all-reduce, against the doctor's smoke test
(`dtlab.cli.doctor.smoke_allreduce`, a 2-rank calibration of 4 KiB and 1 MiB)."""

from __future__ import annotations

import math

from dtlab.course.checks import tol_from_spread
from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key
from dtlab.results.calibration import samples_frame

LAB = "00_setup_check"
MIB = 1 << 20
ORDERS = {"10 us": 0.01, "1 ms": 1.0, "100 ms": 100.0}  # the choices, in ms


def sources(rec) -> dict:
    """The smoke test's calibration directory (it runs under the notebook's TMPDIR)."""
    return {
        "smoke_dir": lambda: rec.calib_dir(
            {"nproc": 2, "ops": ["all_reduce"], "sizes": [4096, MIB]},
            "the setup check's 2-rank all-reduce (smoke_allreduce)",
        )
    }


def _ms(smoke_dir) -> dict:
    _, s = samples_frame(smoke_dir)
    if s.empty or MIB not in set(s["nbytes"]):
        raise ValueError(f"{smoke_dir}: no timed 1 MiB all-reduce in the smoke test's samples")
    return {int(n): g["seconds"] * 1e3 for n, g in s.groupby("nbytes")}


def _order(smoke_dir) -> Key:
    measured = float(_ms(smoke_dir)[MIB].median())
    nearest = min(ORDERS, key=lambda k: abs(math.log10(ORDERS[k] / measured)))
    return Key(
        "lab00.q1",
        "choice",
        nearest,
        choices=tuple(ORDERS),
        explanation=f"measured {measured:.3f} ms; on a log scale that is nearest to {nearest}",
        hint="compare the measured 1 MiB median printed above with the three choices on a log scale",
    )


def _time(smoke_dir) -> Key:
    t = _ms(smoke_dir)[MIB]
    return Key(
        "lab00.q2",
        "number",
        float(t.median()),
        rel_tol=tol_from_spread(t, floor=0.1),
        unit="ms",
        tol_source=f"the spread of the {len(t)} timed 1 MiB calls (half their min..max range over the median, "
        "at least 10%)",
        hint="2 ranks exchange about 1 MiB each way: the bytes over this machine's bandwidth, on top of the "
        "latency floor (the 4 KiB time printed above)",
    )


QUESTIONS = (
    Question("lab00.q1", 1, "my_1mib_order", ("smoke_dir",), _order),
    Question("lab00.q2", 1, "my_1mib_allreduce_ms", ("smoke_dir",), _time),
)
