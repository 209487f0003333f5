"""What reading a run costs as it grows: every reader of a run of S steps x R ranks, before and after a change.

The run directories are made, not run: every rank's events are those a DDP rank of the tiny model writes (a step
with 7 buckets, DDP's stats for the sampled steps, the paired baseline steps, the machine events), with step
times drawn from a seeded generator, so a 100,000-step, 8-rank run (6.4 million events) costs a minute to make and
the figures measure the readers alone.

Each reader runs in a process of its own (so each peak memory is that reader's: the process's maximum resident
set, imports included), killed if it holds more than `--mem-gib` GiB (the figure then says so):

- `load_run` from the JSON lines (a run without its columnar copy: recorded before, or a damaged copy; this also
  writes the copy, whose cost and size are given apart), then `load_run` from the copy;
- `summary()`, `breakdown_table()`, the HTML report, the Chrome trace export and `dtlab.cost` of the loaded run;
- the live monitor once the follower has read the whole run: its first view (every step derived), a later view
  and a redraw (the view and the figure: what each redraw costs while it follows a run), and the follower's read.

`--before DIR` times the same readers with the dtlab found in DIR (a checkout of an earlier commit: `git archive
COMMIT dtlab | tar -x -C DIR`) in the same session, so both columns share the machine's load. Times are the median
of `--repeats` runs after one untimed one (one timed run alone from 1 million events up). Not a test: it prints the
figures docs/benchmarks.md quotes.

    python benchmarks/summary_cost.py --steps 300,30000,100000 --ranks 2,8 --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
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


CPU: list = []  # the CPU time (s, every thread of the process) of each `timed` call, in order


def drop_copy(path: str) -> None:
    shutil.rmtree(os.path.join(path, "columns"), ignore_errors=True)


def timed(fn, repeats: int, before=None) -> float:
    """The median of `repeats` timings of `fn()` after an untimed one (0: one timed run alone); `before()` runs
    untimed before each."""
    if repeats == 0:  # one timed run, no untimed one first (a long run's load)
        if before:
            before()
        t, c = time.perf_counter(), time.process_time()
        fn()
        CPU.append(time.process_time() - c)
        return time.perf_counter() - t
    if before:
        before()
    fn()
    out, cpu = [], []
    for _ in range(repeats):
        if before:
            before()
        t, c = time.perf_counter(), time.process_time()
        fn()
        out.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    CPU.append(statistics.median(cpu))
    return statistics.median(out)


def measure(what: str, path: str, repeats: int) -> dict:
    """One reader, in this process (a child of `main`): {name: seconds, ...}."""
    import warnings

    from dtlab.results.run import load_run

    warnings.simplefilter("ignore")
    if what == "lines":
        out = {"load_lines": timed(lambda: load_run(path), repeats, before=lambda: drop_copy(path))}
        try:
            from dtlab.results import columns
        except ImportError:  # a dtlab before the columnar copy
            return out
        frames = {}
        run = load_run(path)  # from the copy just written
        from dtlab.results.run import COPIED

        frames = {n: getattr(run, n) for n in COPIED}
        index = json.load(open(os.path.join(path, "columns", "index.json")))
        tmp = tempfile.mkdtemp(prefix="dtlab-copy-")
        os.makedirs(os.path.join(tmp, "events"))
        t = time.perf_counter()
        columns.write_copy(tmp, frames, index["extras"], index["sources"])
        out["copy_write"] = time.perf_counter() - t
        out["copy_mb"] = sum(e.stat().st_size for e in os.scandir(os.path.join(tmp, "columns"))) / 1e6
        shutil.rmtree(tmp)
        return out
    if what == "copy":
        return {"load_copy": timed(lambda: load_run(path), repeats)}
    if what == "monitor":
        from dtlab.results.live import LiveRun
        from dtlab.results.live_stats import live_view
        from dtlab.viz.monitor import monitor_figure

        live = LiveRun(path)
        t, c = time.perf_counter(), time.process_time()
        live.close()
        out = {"follow": time.perf_counter() - t, "follow_cpu": time.process_time() - c}
        # the first view derives every step read so far (a monitor opened on a long run); a later one, what each
        # redraw costs once the monitor has followed the run (an earlier dtlab derives everything every time)
        out["first_view"] = timed(lambda: live_view(live, state="finished"), 0)
        out["view"] = timed(lambda: live_view(live, state="finished"), repeats)
        out["redraw"] = timed(lambda: monitor_figure(live_view(live, state="finished")), repeats)
        return out
    run = load_run(path)
    from dtlab.results.chrome import write_chrome_trace
    from dtlab.results.cost import cost
    from dtlab.viz.report import write_report

    report = os.path.join(tempfile.mkdtemp(prefix="dtlab-report-"), "report.html")
    trace = os.path.join(os.path.dirname(report), "trace.json")  # what `dtlab trace` and run.to_chrome_trace(path) do
    readers = {
        "summary": run.summary,
        "table": run.breakdown_table,
        "report": lambda: write_report(run, report),
        "chrome": lambda: os.remove(write_chrome_trace(run, trace)),  # the file written, then let go
        "cost": lambda: cost(run),
    }
    skip = set(os.environ.get("DTLAB_BENCH_SKIP", "").split(","))
    return {name: timed(fn, repeats) for name, fn in readers.items() if name not in skip}


def child(what: str, path: str, repeats: int, code: str | None, mem_gib: float) -> dict:
    """`measure` in a fresh process (with the dtlab in `code`, if given), killed past `mem_gib` GiB resident."""
    env = dict(os.environ, PYTHONPATH=code) if code else dict(os.environ)
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", what, "--path", path, "--repeats", str(repeats)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        except (OSError, StopIteration):
            rss = 0
        peak = max(peak, rss)
        if rss > mem_gib * 2**30:
            proc.kill()
            proc.wait()
            return {"error": f"over {mem_gib:g} GiB"}
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        return {"error": (err.strip().splitlines() or ["failed"])[-1][:120]}
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="300,3000,30000")
    ap.add_argument("--ranks", default="2,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default=None, help="a folder holding an earlier dtlab, timed beside this one")
    ap.add_argument("--mem-gib", type=float, default=7.0, help="kill a reader holding more than this (GiB)")
    ap.add_argument("--skip", default="", help="readers not to time: lines,copy,readers,monitor,summary,chrome,...")
    ap.add_argument("--root", default=None, help="where the run directories are made (kept between calls)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        out = measure(a.measure, a.path, a.repeats)
        timings = [k for k in out if k not in ("copy_mb", "copy_write", "follow", "follow_cpu")]  # `timed` took these
        out.update({f"{k}_cpu": c for k, c in zip(timings, CPU)})
        out["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(json.dumps(out))
        return
    root = a.root or tempfile.mkdtemp(prefix="dtlab-summary-cost-")
    rows, skip = [], set(a.skip.split(","))
    os.environ["DTLAB_BENCH_SKIP"] = a.skip  # the readers' own names, for the children
    codes = [("after", None)] + ([("before", os.path.abspath(a.before))] if a.before else [])
    codes = [c for c in codes if c[0] not in skip]  # --skip after: time the earlier dtlab alone
    for steps in (int(x) for x in a.steps.split(",")):
        for ranks in (int(x) for x in a.ranks.split(",")):
            path = os.path.join(root, f"s{steps}r{ranks}")
            if not os.path.isfile(os.path.join(path, "events", f"rank{ranks - 1}.jsonl")):
                shutil.rmtree(path, ignore_errors=True)
                make_run(path, steps, ranks)
            files = [os.path.join(path, "events", f"rank{r}.jsonl") for r in range(ranks)]
            n = sum(open(p, "rb").read().count(b"\n") for p in files)
            repeats = a.repeats if n < 1_000_000 else 0
            found = {name: {"steps": steps, "ranks": ranks, "events": n, "code": name} for name, _ in codes}
            for what in ("lines", "copy", "readers", "monitor"):
                for code_name, code in codes:  # side by side, one reader at a time: both see the same load
                    if what in skip or (what == "copy" and code_name == "before"):
                        continue
                    if code_name == "before" and (
                        (what == "readers" and "lines_error" in found[code_name])
                        or (what == "monitor" and repeats == 0)
                    ):
                        continue  # they load the run as its load did; the monitor's cost is shown up to 1M events
                    got = child(what, path, repeats, code, a.mem_gib)
                    found[code_name].update(
                        {f"{what}_{k}" if k in ("peak_gib", "error") else k: v for k, v in got.items()}
                    )
            for row in found.values():
                row["json_mb"] = sum(os.path.getsize(p) for p in files) / 1e6
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    print(table(rows))


#: the reader (child process) each column of the table comes from
GROUP = {"load_lines": "lines", "load_copy": "copy", "summary": "readers", "redraw": "monitor", "view": "monitor"}
GROUP.update({"load_lines_cpu": "lines", "load_copy_cpu": "copy", "summary_cpu": "readers"})


def table(rows: list[dict]) -> str:
    """The figures as docs/benchmarks.md's table: microseconds an event for the loads, seconds for the rest."""
    cols = [
        ("load_lines", "lines us/ev", 1e6),
        ("load_lines_cpu", "lines CPU us/ev", 1e6),
        ("load_copy", "copy us/ev", 1e6),
        ("load_copy_cpu", "copy CPU us/ev", 1e6),
        ("lines_peak_gib", "peak GiB", 1),
        ("copy_write", "copy write s", 1),
        ("copy_mb", "copy MB", 1),
        ("summary", "summary s", 1),
        ("summary_cpu", "summary CPU s", 1),
        ("table", "table s", 1),
        ("report", "report s", 1),
        ("chrome", "chrome s", 1),
        ("cost", "cost s", 1),
        ("first_view_cpu", "first view CPU s", 1),
        ("view_cpu", "view CPU s", 1),
        ("redraw", "redraw s", 1),
        ("redraw_cpu", "redraw CPU s", 1),
        ("chrome_cpu", "chrome CPU s", 1),
        ("follow", "follow us/ev", 1e6),
        ("follow_cpu", "follow CPU us/ev", 1e6),
        ("monitor_peak_gib", "monitor GiB", 1),
    ]
    out = ["| steps x ranks | events | code | " + " | ".join(c[1] for c in cols) + " |"]
    out.append("| --- " * (3 + len(cols)) + "|")
    for r in rows:
        cells = []
        for key, _, scale in cols:
            v = r.get(key)
            if v is None:
                cells.append(r.get(f"{GROUP.get(key, '')}_error", ""))
            elif key in ("load_lines", "load_copy", "follow", "load_lines_cpu", "load_copy_cpu", "follow_cpu"):
                cells.append(f"{v / r['events'] * scale:.2f}")
            else:
                cells.append(f"{v * scale:.3g}")
        out.append(f"| {r['steps']:,} x {r['ranks']} | {r['events']:,} | {r['code']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
