"""Explorer redraw time: move each control of `dtlab.viz.dashboard.explorer()` 50 times, print median and max.

A redraw is what one slider move costs in the kernel: re-evaluating the model (bucket layout, alpha-beta
durations, queue simulation for the current setting and every bar of the breakdown) and updating both
FigureWidgets in one batch. The browser's rendering comes on top and is not measured here. Not a test: it
prints figures for the docs. Wall-clock times; a busy machine inflates them, so the CPU time of the process
is printed too.

    python benchmarks/explorer_redraw.py [--moves 50] [--profile runs/profile]
"""

import argparse
import statistics
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moves", type=int, default=50, help="moves per control")
    ap.add_argument("--profile", default=None, help="a profile directory (default: uncalibrated defaults)")
    a = ap.parse_args()

    from dtlab.viz.dashboard import explorer

    profile = None
    if a.profile:
        from dtlab.results.calibration import load_profile

        profile = load_profile(a.profile)
    t0 = time.perf_counter()
    ex = explorer(profile=profile)
    print(
        f"build {1e3 * (time.perf_counter() - t0):.0f} ms (first FigureWidget included); "
        f"DistilBERT, {ex.result['n_buckets']} buckets at the start"
    )

    s = ex.sliders
    moves = {
        "nproc": [(7 * i + 3) % 64 + 1 for i in range(1, a.moves + 1)],  # hops across 1..64, never repeats
        "bucket_mb": list(np.geomspace(0.25, 1024, a.moves)),
        "alpha_us": list(np.geomspace(1, 1000, a.moves)),
        "bandwidth_gbs": list(np.geomspace(0.5, 500, a.moves)),
        "form": ["textbook", "ring"] * (a.moves // 2),
        "sweep": ["bucket_mb", "nproc"] * (a.moves // 2),
    }
    rows = []
    for name, values in moves.items():
        # every value differs from the one before it (and from the start value), so every move redraws
        n0 = len(ex.redraw_times)
        c0 = time.process_time()
        for v in values:
            s[name].value = v
        times = ex.redraw_times[n0:]
        cpu = (time.process_time() - c0) / max(1, len(times))
        rows.append((name, len(times), statistics.median(times) * 1e3, max(times) * 1e3, cpu * 1e3))
    print(f"{'control':<14}{'redraws':>8}{'median ms':>11}{'max ms':>9}{'cpu ms/redraw':>15}")
    for name, n, med, mx, cpu in rows:
        print(f"{name:<14}{n:>8}{med:>11.1f}{mx:>9.1f}{cpu:>15.1f}")
    allt = [t * 1e3 for t in ex.redraw_times[1:]]
    print(f"{'all':<14}{len(allt):>8}{statistics.median(allt):>11.1f}{max(allt):>9.1f}")


if __name__ == "__main__":
    main()
