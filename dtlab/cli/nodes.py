"""`dtlab slurm` and `dtlab emulate`: the command lines of dtlab.launching.slurm and dtlab.launching.emulate.

    dtlab slurm [run flags] --out /shared/runs/x --nodes 2 --gpus-per-node 4 [--partition gpu] [--dry-run]
    dtlab emulate check                                   # can this machine shape a link? (exit 0 yes, 3 no)
    dtlab emulate run [run flags] [--nnodes 2] [--rate 1gbit]
    dtlab emulate calibrate [calibrate flags] --nproc 1 [--rate 1gbit]

Without --rate the emulated nodes talk over loopback (no permission needed); with it, through a tc-shaped veth
pair between network namespaces, which needs root: without that, `emulate` says why and skips (exit 3).
"""

from __future__ import annotations

import shutil
import sys

from dtlab.cli.flags import RUN_ALIASES, add_arguments, add_calib_arguments, calib_from_args, from_args
from dtlab.config.run import RunConfig
from dtlab.launching.emulate import Emulation, EmulationUnavailable, shaping_unavailable
from dtlab.launching.slurm import prepare, submit_script
from dtlab.results.status import RunFailed

SKIPPED = 3  # exit code: emulation with a shaped link is not possible here (the reason is printed)
_EMULATE_SKIP = ("rdzv_endpoint", "rdzv_id")  # the emulation sets these


def add_parsers(sub) -> None:
    """Add the `slurm` and `emulate` subcommands to `dtlab`'s subparsers."""

    s = sub.add_parser("slurm", help="write (and submit) an sbatch script running `srun torchrun` on N nodes")
    add_arguments(
        s,
        RunConfig,
        skip=("nnodes", "rdzv_endpoint", "rdzv_id"),
        aliases=RUN_ALIASES,
        group_titles={"zero": "ZeRO-3 (strategy zero3); None = sized from the model"},
    )
    s.add_argument("--nodes", type=int, required=True, help="nodes to allocate (one torchrun agent each)")
    s.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node = ranks per node (0: CPU nodes, --nproc ranks each)"
    )
    s.add_argument("--partition", default=None, help="Slurm partition")
    s.add_argument("--time", default=None, help="Slurm time limit (default: --timeout-s, rounded up to minutes)")
    s.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        help="an extra #SBATCH line, e.g. --sbatch-arg=--account=abc (repeatable)",
    )
    s.add_argument(
        "--setup",
        default=None,
        help="shell line(s) run before torchrun, e.g. 'source venv/bin/activate' "
        "(default: put this Python's bin directory on PATH)",
    )
    s.add_argument("--dry-run", action="store_true", help="write and print the script, do not submit it")

    e = sub.add_parser("emulate", help="a multi-node job on this machine: loopback, or a tc-shaped link (root)")
    esub = e.add_subparsers(dest="emulate_cmd", required=True, parser_class=sub._parser_class)
    esub.add_parser("check", help="say whether this machine can emulate a shaped link, and why not")
    r = esub.add_parser("run", help="a training run on emulated nodes (flags as `dtlab run`)")
    add_arguments(
        r,
        RunConfig,
        skip=_EMULATE_SKIP,
        aliases=RUN_ALIASES,
        group_titles={"zero": "ZeRO-3 (strategy zero3); None = sized from the model"},
    )
    c = esub.add_parser("calibrate", help="calibrate across emulated nodes (flags as `dtlab calibrate`)")
    add_calib_arguments(c)
    for p in (r, c):
        p.set_defaults(nnodes=2)
        p.add_argument(
            "--rate",
            default=None,
            help="shape the link between the nodes to this tc rate each way "
            "(e.g. 1gbit = 125,000,000 B/s); needs root. Default: loopback, unshaped",
        )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args) -> int:
    """Run `dtlab slurm` or `dtlab emulate` (bad input raises ValueError: `dtlab` prints it and exits 2)."""
    if args.cmd == "slurm":
        return _slurm(args)

    if args.emulate_cmd == "check":
        reason = shaping_unavailable()
        print(
            "dtlab emulate: a shaped link can be emulated here (root, ip, tc, network namespaces)"
            if reason is None
            else f"dtlab emulate: no shaped link here: {reason}; loopback emulation (no --rate) still works"
        )
        return 0 if reason is None else SKIPPED
    return _emulate(args)


def _slurm(args) -> int:

    cfg = from_args(args, RunConfig, skip=("nnodes", "rdzv_endpoint", "rdzv_id"))
    if not args.dry_run and shutil.which("sbatch") is None:
        print(
            "dtlab slurm: error: sbatch not found: this machine is not a Slurm submit host (--dry-run writes "
            "and prints the script without submitting it)",
            file=sys.stderr,
        )
        return 1
    path = prepare(
        cfg,
        args.nodes,
        args.gpus_per_node,
        partition=args.partition,
        time_limit=args.time,
        setup=args.setup,
        sbatch_args=tuple(args.sbatch_arg),
        dry_run=args.dry_run,
    )
    if args.dry_run:
        with open(path) as f:
            print(f.read(), end="")
        print(
            f"# written to {path} (not submitted: --dry-run; the same command without it submits it there)",
            file=sys.stderr,
        )
        return 0
    try:
        job = submit_script(path)
    except RuntimeError as e:
        print(f"dtlab slurm: error: {e}", file=sys.stderr)
        return 1
    print(f"submitted job {job}: {path}; results in {cfg.out} (dtlab show {cfg.out} when it is done)")
    return 0


def _emulate(args) -> int:

    try:
        with Emulation(args.nnodes, rate=args.rate) as em:
            if args.emulate_cmd == "run":
                run = em.run(from_args(args, RunConfig, skip=_EMULATE_SKIP), progress=not args.no_progress)
                print(run.breakdown_table())
            else:
                from dtlab.model.profile import profile_table

                print(profile_table(em.calibrate(calib_from_args(args), progress=not args.no_progress)))
    except EmulationUnavailable as e:
        print(f"dtlab emulate: {e}; skipped", file=sys.stderr)
        return SKIPPED
    except RunFailed as e:
        print(f"dtlab emulate: run failed: {e}", file=sys.stderr)
        return 1
    return 0
