"""What the grading sandbox costs: one batch of honest quick-mode lab 01 notebooks (each trains its 2 gloo ranks)
graded with `dtlab grade --sandbox none`, `bwrap` and `namespaces`, in rounds that alternate the mechanisms.

    python benchmarks/sandbox_overhead.py [--notebooks 2] [--rounds 1]

Prints each batch's wall time and each sandbox's overhead over the unsandboxed batches' mean."""
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notebooks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dtlab-sandbox-bench-")
    os.makedirs(os.path.join(root, "ag"))
    zipfile.ZipFile(os.path.join(root, "ag", "01_ddp_breakdown.zip"), "w").close()
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": HONEST}],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    subs = []
    for i in range(args.notebooks):
        d = os.path.join(root, f"student{i}")
        os.makedirs(d)
        with open(os.path.join(d, "01_ddp_breakdown.ipynb"), "w") as f:
            json.dump(nb, f)
        subs.append(d)
    times = {}
    for r in range(args.rounds):
        for mech in ("none", "bwrap", "namespaces", "none"):
            csv = os.path.join(root, f"{mech}-{r}.csv")
            t = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "dtlab", "grade", os.path.join(root, "ag"), *subs,
                                "--sandbox", mech, "--csv", csv], capture_output=True, text=True)
            dt = time.perf_counter() - t
            ok = p.returncode == 0 and "4.0         4.0" in p.stdout
            times.setdefault(mech, []).append(dt)
            print(f"round {r} {mech:10s} {dt:6.1f} s for {args.notebooks} notebooks ({'full marks' if ok else 'NOT OK'})",
                  flush=True)
    base = statistics.mean(times["none"])
    for mech in ("bwrap", "namespaces"):
        m = statistics.mean(times[mech])
        print(f"{mech}: {m:.1f} s vs {base:.1f} s unsandboxed: {100 * (m - base) / base:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
