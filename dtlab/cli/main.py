"""`dtlab` command line: run, show, trace, calibrate, nccl-tests, slurm, emulate, doctor, assign and grade. Bad input
exits with code 2 and a one-line error."""

from __future__ import annotations

import argparse
import glob
import os
import sys
import warnings

import dtlab
from dtlab.cli import nccltests
from dtlab.cli.doctor import main as doctor_main
from dtlab.cli.flags import RUN_ALIASES, add_arguments, add_calib_arguments, calib_from_args, from_args
from dtlab.cli.nodes import add_parsers
from dtlab.cli.nodes import main as nodes_main
from dtlab.config.run import RunConfig
from dtlab.course.batch import grade
from dtlab.course.limits import parse_size
from dtlab.results.status import RunFailed
from dtlab.runfiles import RunDamageWarning


def _run_parser(sub) -> None:
    """`dtlab run`: one flag per RunConfig field (same names, defaults and help as the config), plus report
    and progress options."""

    p = sub.add_parser("run", help="launch a training run and print its T_comp / T_comm breakdown")
    add_arguments(
        p, RunConfig, group_titles={"zero": "ZeRO-3 (strategy zero3); None = sized from the model"}, aliases=RUN_ALIASES
    )
    p.add_argument("--report", default=None, help="HTML report path (default OUT/report.html)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit code 2 (argparse would print the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole `dtlab` parser. `run` and `calibrate` flags are generated from RunConfig and CalibConfig."""

    parser = _Parser(prog="dtlab", description=__doc__)
    where = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--version", action="version", version=f"dtlab {dtlab.__version__} from {where}")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    _run_parser(sub)
    s = sub.add_parser("show", help="print the breakdown of a finished (or partial) run")
    s.add_argument("dir")
    t = sub.add_parser(
        "trace",
        help="read PyTorch profiler traces (a file, a folder of one per rank): the breakdown "
        "per rank and step, the collectives, an HTML report; or write a run as a "
        "Chrome/Perfetto trace (open in ui.perfetto.dev)",
    )
    t.add_argument("dir", help="a Kineto trace (.json, .json.gz), a folder of them, or a dtlab run directory")
    t.add_argument("-o", "--output", default=None, help="a run's exported trace file (default DIR/trace.json)")
    t.add_argument(
        "--report", default=None, help="HTML report of profiler traces (default: beside them, trace-report.html)"
    )
    c = sub.add_parser("calibrate", help="time collectives, fit alpha and beta, write a machine profile")
    add_calib_arguments(c)
    a = sub.add_parser(
        "assign",
        help="student notebooks and autograders from otter master notebooks "
        '(needs the course extra: pip install -e ".[course]")',
    )
    a.add_argument("source", help="a master notebook or a directory of them (the labs' masters: instructor)")
    a.add_argument("out", help="writes OUT/student/*.ipynb, OUT/autograder/<lab>.zip, OUT/instructor/*.ipynb")
    g = sub.add_parser(
        "grade",
        help="grade submitted notebooks headless (from their recorded runs when they "
        "have them, else in quick mode); one row per student and question",
    )
    g.add_argument("autograder", help="an autograder .zip, or `dtlab assign`'s OUT/autograder directory")
    g.add_argument(
        "submissions",
        nargs="+",
        help="submitted notebooks, or directories (one per student) holding "
        "the notebooks and the runs/ and profiles/ they wrote",
    )
    g.add_argument(
        "--csv",
        default=None,
        help="write the scores here, rewritten after every notebook (student, "
        "notebook, lab, question, points, max_points, feedback, status, mode, "
        "replayed, flags, errors)",
    )
    g.add_argument(
        "--lab",
        default=None,
        help="the lab of every submitted notebook (e.g. 01_ddp_breakdown), for "
        "names that do not say it; default: the name, else the metadata",
    )
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds one notebook may take (default 3600)")
    g.add_argument(
        "--sandbox",
        default="auto",
        choices=("auto", "bwrap", "namespaces", "none"),
        help="where each notebook runs: auto (the strongest available here, default; refuses when none "
        "is), bwrap (bubblewrap), namespaces (unshare), none (the students' code with your "
        "permissions: only when given explicitly)",
    )
    g.add_argument("--memory", default="4G", help="memory limit per process in the sandbox (default 4G)")
    g.add_argument("--disk", default="1G", help="size of the sandbox's scratch disk, /tmp (default 1G)")
    g.add_argument("--max-procs", type=int, default=512, help="processes and threads in the sandbox (default 512)")
    add_parsers(sub)
    nccltests.add_parser(sub)
    sub.add_parser(
        "doctor", help="what this machine can run and how each lab will run on it (dtlab doctor --help)", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["doctor"]:  # its own parser: `dtlab doctor --json --smoke`
        return doctor_main(argv[1:])
    args = parser.parse_args(argv)
    try:
        if args.cmd == "run":
            return _cmd_run(args)
        if args.cmd == "show":
            return _cmd_show(args)
        if args.cmd == "trace":
            return _cmd_trace(args)
        if args.cmd == "calibrate":
            return _cmd_calibrate(args)
        if args.cmd in ("assign", "grade"):
            return _cmd_course(args)
        if args.cmd in ("slurm", "emulate"):
            return nodes_main(args)
        if args.cmd == "nccl-tests":
            return nccltests.main(args)
    except ValueError as e:  # bad input: one line, exit 2, nothing started
        print(f"dtlab: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 2


def _cmd_course(args) -> int:
    from dtlab.course.assign import assign

    try:
        if args.cmd == "assign":
            assign(args.source, args.out)
            return 0

        df = grade(
            args.autograder,
            args.submissions,
            csv=args.csv,
            lab=args.lab,
            timeout_s=args.timeout,
            sandbox=args.sandbox,
            memory=parse_size(args.memory),
            disk=parse_size(args.disk),
            procs=args.max_procs,
        )
    except RuntimeError as e:  # otter-grader missing, or otter failed: say so in one paragraph
        print(f"dtlab {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    print(df.groupby(["student", "notebook"])[["points", "max_points"]].sum().to_string())
    bad = df[df["status"] == "error"].groupby(["student", "notebook"]).ngroups
    if bad:
        print(
            f"dtlab grade: {bad} notebook(s) could not be graded: their rows say why (status 'error')", file=sys.stderr
        )
    if args.csv:
        print(f"scores: {args.csv} ({len(df)} rows)")
    return 0


def _cmd_run(args) -> int:
    from dtlab.launching.handle import launch
    from dtlab.viz.report import write_report

    cfg = from_args(args, RunConfig)
    placed = cfg.validate().placement()
    print(
        f"dtlab: {placed.label}"
        + (f"\n  note: {placed.note}" if placed.note else "")
        + f"\n  timed with {placed.timing}",
        file=sys.stderr,
    )
    try:  # a launch can fail too (a full disk: nothing started)
        handle = launch(cfg)
        run = handle.wait(progress=not args.no_progress)
    except RunFailed as e:
        print(f"dtlab: run failed: {e}", file=sys.stderr)
        return 1
    _print_run(run)
    if getattr(handle, "node", None) is not None and handle.node.slot:  # one report per run: node slot 0 writes it
        print(f"  report: written by node slot 0 of {handle.node.nnodes}")
        return 0
    path = write_report(run, args.report)
    print(f"  report: {path}")
    return 0


def _cmd_show(args) -> int:
    """Print a run's breakdown, with how it ended and any damage found reading it (dtlab.results.status). Exit code 0
    for a finished (or still running) run, 1 for any other state (failed, abandoned, incomplete, ...); a run
    directory that cannot be read (DamagedRun, a ValueError) is one line and exit code 2."""

    from dtlab.results.run import load_run

    if not os.path.isfile(os.path.join(args.dir, "config.json")):
        raise ValueError(f"dir: {args.dir!r} is not a dtlab run directory (no config.json)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunDamageWarning)  # the table prints each one
        run = load_run(args.dir)
    _print_run(run)
    return 0 if run.status.get("state") in ("finished", "running") else 1


def _print_run(run) -> None:
    """The breakdown table, and for a straggler run who waited for whom."""
    print(run.breakdown_table())
    if run.config.stragglers.slow and not run.buckets.empty:
        from dtlab.results.stragglers import wait_table

        print(wait_table(run))


def _cmd_trace(args) -> int:
    """A dtlab run directory: its Chrome/Perfetto export (and, with profile=True, its profiler traces read too);
    anything else: profiler traces read with dtlab's definitions, printed and written as an HTML report."""

    from dtlab.results.run import load_run

    is_run = os.path.isfile(os.path.join(args.dir, "config.json"))
    if not is_run or os.path.isdir(os.path.join(args.dir, "profiler")):
        if not is_run and os.path.isdir(args.dir) and not _has_traces(args.dir):
            raise ValueError(
                f"dir: {args.dir!r} is not a dtlab run directory (no config.json) and holds no "
                "profiler traces (*.json, *.json.gz)"
            )
        _print_kineto(args)
        if not is_run:
            return 0
    run = load_run(args.dir)
    path = run.to_chrome_trace(args.output or os.path.join(args.dir, "trace.json"))
    print(
        f"trace: {path} ({len(run.steps) + len(run.baseline_steps)} steps, "
        f"{len(run.buckets) or len(run.collectives)} collectives); open it in ui.perfetto.dev or chrome://tracing"
    )
    return 0


def _has_traces(folder: str) -> bool:
    return any(p.endswith((".json", ".json.gz")) for p in glob.glob(os.path.join(folder, "*")))


def _print_kineto(args) -> None:
    """Print a profiler trace's summary and write its HTML report."""

    from dtlab.results.kineto import load_trace
    from dtlab.viz.trace_report import write_trace_report

    trace = load_trace(args.dir)
    print(trace.summary_text())
    where = args.dir if os.path.isdir(args.dir) else os.path.dirname(os.path.abspath(args.dir))
    if os.path.isfile(os.path.join(args.dir, "config.json")):
        where = os.path.join(args.dir, "profiler")
    print(f"\n  report: {write_trace_report(trace, args.report or os.path.join(where, 'trace-report.html'))}")


def _cmd_calibrate(args) -> int:
    from dtlab.launching.calibration import launch_calibration  # scipy and pandas: not for --help
    from dtlab.model.profile import profile_table

    try:
        profile = launch_calibration(calib_from_args(args)).wait(progress=not args.no_progress)
    except RunFailed as e:
        print(f"dtlab: calibration failed: {e}", file=sys.stderr)
        return 1
    print(profile_table(profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
