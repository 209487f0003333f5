"""Does `dtlab calibrate` across two emulated nodes recover the bandwidth of the link between them? Not a test:
it needs root and Linux network namespaces (it says why and exits 3 without them), and it prints a table.

Two nodes, one rank each, each in its own network namespace, joined by a veth pair shaped by tc tbf to --rate
each way (dtlab.launching.emulate). All-reduce is calibrated across them (sizes 1 to 32 MiB, the bandwidth-bound regime)
and the ring fit's 1/beta compared with the set rate: for 2 ranks the ring moves n bytes each way per
all-reduce, so 1/beta should be the link's rate (less TCP/IP headers, about 4.4% at a 1500-byte MTU).

For contrast, the same sweep between 2 ranks of one node (loopback, no shaping): the intra-node level. The ratio
of the two at the largest size is how much the inter-node level dominates a step's communication.

    python benchmarks/shaped_link.py --rate 1gbit
"""

import argparse
import sys

from dtlab.config.calibration import CalibConfig
from dtlab.launching.calibration import calibrate
from dtlab.launching.emulate import Emulation, EmulationUnavailable, parse_rate, shaping_unavailable

SIZES = tuple(1 << k for k in range(20, 26))  # 1 MiB .. 32 MiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="tc rate of the emulated link, each way (default 1gbit)")
    ap.add_argument("--iters", type=int, default=6, help="timed samples per size")
    ap.add_argument("--tolerance", type=float, default=0.15, help="allowed relative error of 1/beta")
    args = ap.parse_args()
    reason = shaping_unavailable()
    if reason:
        print(f"skipped: {reason}")
        return 3
    want = parse_rate(args.rate)
    cfg = CalibConfig(nproc=1, sizes=SIZES, iters=args.iters, rounds=2, warmup=2)
    try:
        with Emulation(2, rate=args.rate) as em:
            inter = em.calibrate(cfg, progress=False)
    except EmulationUnavailable as e:
        print(f"skipped: {e.reason}")
        return 3
    intra = calibrate(nproc=2, sizes=SIZES, iters=args.iters, rounds=2, warmup=2, progress=False)
    fi, fa = inter.fits["all_reduce"], intra.fits["all_reduce"]
    got = 1 / fi.beta
    err = got / want - 1
    print(f"link: {inter.meta['emulation']['link']}")
    print(
        f"inter-node (2 nodes x 1 rank): alpha {fi.alpha * 1e6:8.0f} us   1/beta {got / 1e6:7.1f} MB/s   "
        f"set {want / 1e6:.1f} MB/s   error {err:+.1%}   ({'within' if abs(err) <= args.tolerance else 'OUTSIDE'} "
        f"{args.tolerance:.0%})   profile {inter.meta['calibration']['out']}"
    )
    print(f"intra-node (1 node x 2 ranks): alpha {fa.alpha * 1e6:8.0f} us   1/beta {1 / fa.beta / 1e6:7.1f} MB/s")
    print("size        inter-node   intra-node   inter / intra   (median of the slowest rank per sample)")
    si = inter.samples.groupby("nbytes")["seconds"].median()
    sa = intra.samples.groupby("nbytes")["seconds"].median()
    for n in sorted(set(si.index) & set(sa.index)):
        print(f"{n / 2**20:5.0f} MiB   {si[n] * 1e3:8.1f} ms  {sa[n] * 1e3:8.1f} ms   {si[n] / sa[n]:8.1f}x")
    return 0 if abs(err) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
