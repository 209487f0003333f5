"""What reading a run costs as it grows: load_run, summary() and the HTML report for runs of S steps x R ranks.

The run directories are made, not run: every rank's events are those a DDP rank of the tiny model writes (a step
with 7 buckets, DDP's stats for the sampled steps, the paired baseline steps, the machine events), with step
times drawn from a seeded generator, so a 30,000-step, 8-rank run costs seconds to make and the figures measure
the reader alone. Each figure is the median of `--repeats` timings in one process, after one untimed read.
Not a test: it prints the figures docs/benchmarks.md quotes.

    python benchmarks/summary_cost.py --steps 300,3000,30000 --ranks 2,4,8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from dtlab.config.baseline import run_order


def make_run(path: str, steps: int, ranks: int, baseline_steps: int = 3, buckets: int = 7, seed: int = 0) -> str:
    rng = random.Random(seed)
    os.makedirs(os.path.join(path, "events"))
    cfg = {
        "strategy": "ddp",
        "nproc": ranks,
        "steps": steps,
        "warmup": 2,
        "baseline_steps": baseline_steps,
        "bucket_mb": 25,
        "batch_size": 8,
        "seq_len": 64,
        "model": "tiny",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"config": cfg, "resolved": {"world_size": ranks, "backend": "gloo"}}, f)
    with open(os.path.join(path, "status.json"), "w") as f:
        json.dump({"state": "finished"}, f)
    order = run_order(steps, 2, baseline_steps)
    stat = {"user": 0, "nice": 0, "system": 0, "idle": 0, "iowait": 0, "irq": 0, "softirq": 0, "steal": 0}
    for r in range(ranks):
        lines = [
            {"kind": "start", "rank": r, "pid": 1000 + r, "world_size": ranks, "host": "h"},
            {
                "kind": "machine",
                "rank": r,
                "phase": "start",
                "time": 0.0,
                "cpu_s": 0.0,
                **({"stat": stat, "ticks": 100, "cores": 2, "loadavg": [0.5, 0.5, 0.5]} if r == 0 else {}),
            },
        ]
        for s, paired in order:
            fwd, bwd, opt = 0.004 * rng.uniform(0.9, 1.2), 0.009 * rng.uniform(0.9, 1.2), 0.002
            kind = "step" if paired is None else "baseline_step"
            ev = {
                "kind": kind,
                "rank": r,
                "step": s,
                "t_fwd": fwd,
                "t_bwd": bwd,
                "t_opt": opt,
                "t_step": fwd + bwd + opt,
                "loss": 0.69,
                "micro_batches": 1,
                "straggle_s": 0.0,
                "lr": 1e-3,
                "time": 1.7e9 + s * 0.02,
            }
            if paired is not None:
                ev["paired_step"] = paired
            lines.append(ev)
            if paired is None:
                t = fwd + 0.3 * bwd
                for b in range(buckets):
                    lines.append(
                        {
                            "kind": "bucket",
                            "rank": r,
                            "step": s,
                            "bucket": b,
                            "nbytes": 100_000,
                            "nparams": 3,
                            "wire_bytes": 100_000,
                            "t_ready": t,
                            "t_start": t,
                            "t_end": t + 0.001 * rng.uniform(1, 3),
                            "backend_ms": None,
                        }
                    )
                    t += bwd * 0.1
                if 1 <= s <= 10 or s % 100 == 0:
                    lines.append({"kind": "ddp_stats", "rank": r, "step": s - 1, "backward_comm_time": 0.002})
        end = steps * 0.02
        lines.append(
            {
                "kind": "machine",
                "rank": r,
                "phase": "end",
                "time": end,
                "cpu_s": end * 0.9,
                **(
                    {"stat": {**stat, "user": int(end * 200)}, "ticks": 100, "cores": 2, "loadavg": [1.9, 1.0, 0.6]}
                    if r == 0
                    else {}
                ),
            }
        )
        lines.append({"kind": "done", "rank": r})
        with open(os.path.join(path, "events", f"rank{r}.jsonl"), "w") as f:
            f.write("".join(json.dumps(e) + "\n" for e in lines))
    return path


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="300,3000,30000")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report", action="store_true", help="also time the HTML report (plotly)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from dtlab.results.run import load_run

    root = tempfile.mkdtemp(prefix="dtlab-summary-cost-")
    rows = []
    print(
        f"{'steps':>6s} {'ranks':>5s} {'events':>8s} {'load_run s':>10s} {'summary s':>9s} {'table s':>7s}"
        + (f" {'report s':>8s}" if a.report else "")
    )
    for steps in (int(x) for x in a.steps.split(",")):
        for ranks in (int(x) for x in a.ranks.split(",")):
            path = make_run(os.path.join(root, f"s{steps}r{ranks}"), steps, ranks)
            n = sum(1 for r in range(ranks) for _ in open(os.path.join(path, "events", f"rank{r}.jsonl")))
            run = load_run(path)
            row = {
                "steps": steps,
                "ranks": ranks,
                "events": n,
                "load_run_s": timed(lambda path=path: load_run(path), a.repeats),
                "summary_s": timed(run.summary, a.repeats),
                "table_s": timed(run.breakdown_table, a.repeats),
            }
            if a.report:
                from dtlab.viz.report import write_report

                row["report_s"] = timed(
                    lambda run=run, path=path: write_report(run, os.path.join(path, "report.html")), a.repeats
                )
            rows.append(row)
            print(
                f"{steps:6d} {ranks:5d} {n:8d} {row['load_run_s']:10.3f} {row['summary_s']:9.3f} "
                f"{row['table_s']:7.3f}" + (f" {row['report_s']:8.3f}" if a.report else ""),
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
