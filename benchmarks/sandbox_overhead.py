"""What the grading sandbox costs: a batch of honest quick-mode lab 01 notebooks (each trains its 2 gloo ranks)
graded with `dtlab grade --sandbox none`, `bwrap` and `namespaces`.

    python benchmarks/sandbox_overhead.py [--notebooks 10] [--mechanisms none bwrap namespaces]

Interleaved against drift (a machine whose load changes would otherwise bill one mechanism for it): notebook i is
graded once by each mechanism, one after the other, the order rotated from one notebook to the next. A mechanism's
batch time is the sum of its gradings (each a `dtlab grade` of that notebook alone, start to exit). Prints every
grading, each batch's time and each sandbox's overhead against the unsandboxed batch, and the median and range of
the per-notebook ratios."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile

HONEST = '''import dtlab
from dtlab.course.labs import lab_config
from dtlab.course.rubric import lab01 as L
run = dtlab.run(lab_config(), progress=False)
my_bytes_guess = L.grad_bytes(run)
my_buckets_guess = len(L._steady(run))
my_unhidden_bucket = "last ready"'''


def _grade(root: str, sub: str, mech: str, tag: str) -> tuple[float, bool]:
    csv = os.path.join(root, f"{tag}.csv")
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "dtlab", "grade", os.path.join(root, "ag"), sub, "--sandbox", mech, "--csv", csv],
        capture_output=True,
        text=True,
    )
    dt = time.perf_counter() - t
    return dt, p.returncode == 0 and "4.0         4.0" in p.stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notebooks", type=int, default=10)
    ap.add_argument("--mechanisms", nargs="+", default=["none", "bwrap", "namespaces"])
    args = ap.parse_args()
    mechs = args.mechanisms if "none" in args.mechanisms else ["none", *args.mechanisms]
    root = tempfile.mkdtemp(prefix="dtlab-sandbox-bench-")
    os.makedirs(os.path.join(root, "ag"))
    zipfile.ZipFile(os.path.join(root, "ag", "01_ddp_breakdown.zip"), "w").close()
    nb = {
        "cells": [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": HONEST}],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    times = {m: [] for m in mechs}
    for i in range(args.notebooks):
        sub = os.path.join(root, f"student{i}")
        os.makedirs(sub)
        with open(os.path.join(sub, "01_ddp_breakdown.ipynb"), "w") as f:
            json.dump(nb, f)
        for mech in mechs[i % len(mechs) :] + mechs[: i % len(mechs)]:
            dt, ok = _grade(root, sub, mech, f"{mech}-{i}")
            times[mech].append(dt)
            print(f"notebook {i} {mech:10s} {dt:6.1f} s ({'full marks' if ok else 'NOT OK'})", flush=True)
    base = sum(times["none"])
    print(f"\n{args.notebooks} notebooks, none: {base:.1f} s")
    for mech in mechs:
        if mech == "none":
            continue
        total = sum(times[mech])
        ratios = sorted(a / b for a, b in zip(times[mech], times["none"]))
        print(
            f"{mech}: {total:.1f} s, {100 * (total - base) / base:+.1f}% against none; per notebook "
            f"x{statistics.median(ratios):.3f} (median), x{ratios[0]:.3f} .. x{ratios[-1]:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
