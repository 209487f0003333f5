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
    p.add_argument("--warmup", type=int, default=1, help="leading steps left out of medians (default 1)")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dtlab", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    _run_parser(sub)
    s = sub.add_parser("show", help="print the breakdown of a finished (or partial) run")
    s.add_argument("dir")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "run":
            return _cmd_run(args)
        if args.cmd == "show":
            return _cmd_show(args)
    except ValueError as e:  # bad input: one line, exit 2, nothing started
        print(f"dtlab: error: {e}", file=sys.stderr)
        return 2
    return 2


def _cmd_run(args) -> int:
    from .config import RunConfig
    from .launch import launch
    from .report import write_report
    from .results import RunFailed

    from .config import device_count
    nproc = args.nproc if args.nproc is not None else (device_count() or 2)
    baseline = args.baseline_steps if args.baseline_steps is not None else (3 if args.strategy == "ddp" else 0)
    cfg = RunConfig(strategy=args.strategy, nproc=nproc, backend=args.backend, bucket_mb=args.bucket_mb,
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


if __name__ == "__main__":
    sys.exit(main())
