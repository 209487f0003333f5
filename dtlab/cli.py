"""`dtlab` command line: run, show (and calibrate). Bad input exits with code 2 and a one-line error."""

from __future__ import annotations

import argparse
import sys


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="launch a training run and print its T_comp / T_comm breakdown")
    p.add_argument("--strategy", default="ddp", help="ddp or zero3 (default ddp)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: one per GPU, or 2 on CPU)")
    p.add_argument("--backend", default="auto", help="auto, nccl or gloo (default auto)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap in MiB (default 25)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="leading steps left out of medians (default 2)")
    p.add_argument("--baseline-steps", type=int, default=None,
                   help="no-op comm hook steps that measure T_comp (default 3 for ddp, 0 for zero3)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--model", default="distilbert", help="distilbert or tiny (default distilbert)")
    p.add_argument("--model-source", default="auto", help="auto, hub or random (default auto)")
    p.add_argument("--model-path", default=None, help="local Hugging Face model folder")
    p.add_argument("--data", default="auto", help="auto, glue, offline or a local SST-2-format file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before every rank is stopped")
    p.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>)")
    p.add_argument("--report", default=None, help="HTML report path (default OUT/report.html)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    z = p.add_argument_group("ZeRO-3 (strategy zero3; DeepSpeed's defaults)")
    z.add_argument("--zero-reduce-bucket-size", type=int, default=None, help="elements per reduce-scatter bucket")
    z.add_argument("--zero-prefetch-bucket-size", type=int, default=None, help="elements prefetched ahead")
    z.add_argument("--zero-persistence-threshold", type=int, default=None,
                   help="parameters with at most this many elements stay whole on every rank")
    z.add_argument("--zero-max-reuse-distance", type=int, default=None,
                   help="elements; 0 (with prefetch 0) re-gathers parameters in backward")
    z.add_argument("--zero-overlap-comm", choices=["true", "false"], default=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dtlab", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    _run_parser(sub)
    s = sub.add_parser("show", help="print the breakdown of a finished (or partial) run")
    s.add_argument("dir")
    c = sub.add_parser("calibrate", help="time collectives, fit alpha and beta, write a machine profile")
    c.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    c.add_argument("--ops", default="all_reduce", help="comma list of all_reduce, reduce_scatter, all_gather")
    c.add_argument("--sizes", default=None, help="comma list of message sizes in bytes (suffixes K, M: KiB, MiB); "
                   "default 4K,16K,...,64M")
    c.add_argument("--iters", type=int, default=12, help="timed iterations per size (default 12)")
    c.add_argument("--rounds", type=int, default=3, help="shuffled passes over all sizes (default 3)")
    c.add_argument("--warmup", type=int, default=3, help="untimed calls before each timed block (default 3)")
    c.add_argument("--backend", default="auto")
    c.add_argument("--form", default="ring", help="alpha-beta form to fit: ring or textbook (default ring)")
    c.add_argument("--fit-min-bytes", default=None, help="fit only sizes >= this (e.g. 1M)")
    c.add_argument("--out", default=None, help="profile directory (default profiles/calib-...)")
    c.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "run":
            return _cmd_run(args)
        if args.cmd == "show":
            return _cmd_show(args)
        if args.cmd == "calibrate":
            return _cmd_calibrate(args)
    except ValueError as e:  # bad input: one line, exit 2, nothing started
        print(f"dtlab: error: {e}", file=sys.stderr)
        return 2
    return 2


def _cmd_run(args) -> int:
    from .config import RunConfig
    from .launcher import launch
    from .report import write_report
    from .results import RunFailed

    from .config import device_count
    nproc = args.nproc if args.nproc is not None else (device_count() or 2)
    baseline = args.baseline_steps if args.baseline_steps is not None else (3 if args.strategy == "ddp" else 0)
    zero = {k: v for k, v in {
        "reduce_bucket_size": args.zero_reduce_bucket_size, "stage3_prefetch_bucket_size": args.zero_prefetch_bucket_size,
        "stage3_param_persistence_threshold": args.zero_persistence_threshold,
        "stage3_max_reuse_distance": args.zero_max_reuse_distance,
        "overlap_comm": None if args.zero_overlap_comm is None else args.zero_overlap_comm == "true"}.items()
        if v is not None}
    cfg = RunConfig(zero=zero, strategy=args.strategy, nproc=nproc, backend=args.backend, bucket_mb=args.bucket_mb,
                    steps=args.steps, warmup=args.warmup, baseline_steps=baseline, batch_size=args.batch_size,
                    seq_len=args.seq_len, model=args.model, model_source=args.model_source,
                    model_path=args.model_path, data=args.data, seed=args.seed, timeout_s=args.timeout,
                    out=args.out)
    handle = launch(cfg)
    try:
        run = handle.wait(progress=not args.no_progress)
    except RunFailed as e:
        print(f"dtlab: run failed: {e}", file=sys.stderr)
        return 1
    print(run.breakdown_table())
    path = write_report(run, args.report)
    print(f"  report: {path}")
    return 0


def _cmd_show(args) -> int:
    import os

    from .results import load_run
    if not os.path.isfile(os.path.join(args.dir, "config.json")):
        raise ValueError(f"dir: {args.dir!r} is not a dtlab run directory (no config.json)")
    print(load_run(args.dir).breakdown_table())
    return 0


def parse_bytes(text: str, field: str) -> int:
    """'4096', '64K', '16M', '1G' -> bytes (binary units); ValueError naming the field otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a size in bytes (examples: 4096, 64K, 16M)") from None


def _cmd_calibrate(args) -> int:
    from .calibration import DEFAULT_SIZES, CalibConfig, launch_calibration
    from .results import RunFailed
    sizes = tuple(parse_bytes(s, "--sizes") for s in args.sizes.split(",")) if args.sizes else DEFAULT_SIZES
    cfg = CalibConfig(nproc=args.nproc, ops=args.ops, sizes=sizes, iters=args.iters, rounds=args.rounds,
                      warmup=args.warmup,
                      backend=args.backend, form=args.form, out=args.out,
                      fit_min_bytes=parse_bytes(args.fit_min_bytes, "--fit-min-bytes") if args.fit_min_bytes else None)
    try:
        profile = launch_calibration(cfg).wait(progress=not args.no_progress)
    except RunFailed as e:
        print(f"dtlab: calibration failed: {e}", file=sys.stderr)
        return 1
    print(profile_table(profile))
    return 0


def profile_table(profile) -> str:
    """The fitted alpha (microseconds) and beta (as GB/s) per op with 95% intervals, and the caveats."""
    m = profile.meta
    lines = [f"profile {m.get('calibration', {}).get('out', '')}: {m.get('backend')} | {m.get('world_size')} ranks | "
             f"host {m.get('host')} | torch {m.get('versions', {}).get('torch')}"]
    for op, f in sorted(profile.fits.items()):
        lo, hi = f.alpha_ci
        blo, bhi = f.beta_ci
        bw = lambda b: f"{1 / b / 1e9:.3g}" if b > 0 else "inf"  # noqa: E731
        lines.append(f"  {op:<15} {f.form:<8} alpha {f.alpha * 1e6:8.1f} us [{lo * 1e6:.1f}, {hi * 1e6:.1f}]   "
                     f"1/beta {bw(f.beta)} GB/s [{bw(bhi)}, {bw(blo)}]   rel. RMS error {f.rel_rms:.1%}   "
                     f"sizes {f.min_bytes:,}..{f.max_bytes:,} B")
    for c in profile.caveats:
        lines.append(f"  note: {c}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
