"""`dtlab nccl-tests FILE`: a real cluster's nccl-tests output read, fitted and set beside its fit.

    dtlab nccl-tests all_reduce_perf.log                 # a file (every nccl-tests version, launcher prefixes)
    dtlab nccl-tests all_gather.log --op all_gather      # when the output cannot tell its collective
    dtlab nccl-tests --list                              # the public outputs shipped with dtlab
    dtlab nccl-tests gcp-a3mega-h100-2x8-tcpxo           # one of them, by name

Prints where it came from, the single-line and per-regime alpha-beta fits with 95 % intervals, and every size's
measured busbw beside the fit's (GB/s). Damaged or cut output exits 2 naming the line.
"""

from __future__ import annotations

import os

from dtlab.results.nccl_profile import load_nccl_tests, nccl_tests_report, public_nccl_tests
from dtlab.results.nccl_tests import OPS


def add_parser(sub) -> None:
    """Add the `nccl-tests` subcommand to `dtlab`'s subparsers."""
    p = sub.add_parser(
        "nccl-tests", help="read a cluster's nccl-tests output: its table, the alpha-beta fit, busbw against the fit"
    )
    p.add_argument("file", nargs="?", help="an nccl-tests output file, or the name of a shipped one (--list)")
    p.add_argument("--op", choices=OPS, default=None, help="the collective, when the output cannot tell it")
    p.add_argument("--nproc", type=int, default=None, help="rank count, for output without device lines")
    p.add_argument(
        "--nodes", type=int, default=None, help="node count, for output without device lines or with some ranks' only"
    )
    p.add_argument("--min-bytes", type=int, default=None, help="fit only sizes >= this (bytes)")
    p.add_argument("--list", action="store_true", help="list the public nccl-tests outputs shipped with dtlab")


def main(args) -> int:
    """Run `dtlab nccl-tests` with parsed `args`; ValueError (bad input, damaged output) goes to the caller."""
    if args.list:
        listing = public_nccl_tests()
        for r in listing.itertuples():
            print(
                f"{r.name:<32} {r.op:<14} {r.gpus:>3} GPUs {r.nodes:>2} node(s)  {r.interconnect}\n{'':<34}{r.source}"
            )
        return 0
    if not args.file:
        raise ValueError("file: give an nccl-tests output file, or a shipped output's name (dtlab nccl-tests --list)")
    kw = {"op": args.op, "nproc": args.nproc, "nodes": args.nodes, "min_bytes": args.min_bytes}
    names = set(public_nccl_tests()["name"])
    if not os.path.exists(args.file) and args.file in names:
        profile = public_nccl_tests(args.file, **{k: v for k, v in kw.items() if v is not None})
    else:
        profile = load_nccl_tests(args.file if os.path.exists(args.file) else os.fspath(args.file), **kw)
    print(nccl_tests_report(profile))
    return 0
