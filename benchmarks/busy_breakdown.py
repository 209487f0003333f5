"""Busy-machine drill: the README's main job run N times beside loads that change during the run, counting the
breakdowns that print an impossible figure (a negative exposed time, an overlap outside [0, 1]) and how far T_comp
moved from a quiet run's.

Loads (CPU-spinning processes, one per core, each killed by its own pid when the run ends):

- quiet: none;
- flicker: the spinners come and go together, on and off for 0.5 to 3 s at a time (seeded);
- late: the spinners arrive when rank 0 has finished training step LATE (default 4 of 8: late in the training
  steps) and stay until the run ends.

Each run is `python -m dtlab run ...` as a person types it, and the drill reads the breakdown it prints, so it
drills any checkout: `--src DIR` runs the dtlab found in DIR (e.g. an older commit, for a before/after table).
The loads are interleaved (quiet, flicker, late, late, flicker, quiet, ...) so a drift of the machine itself
spreads over all of them. Not a test: it prints the figures docs/benchmarks.md quotes.

    python benchmarks/busy_breakdown.py --runs 3 --json busy.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROWS = ("T_step", "T_comp", "T_comm", "exposed", "overlap")
MAIN_JOB = ["run", "--model", "distilbert", "--steps", "8", "--batch-size", "8", "--seq-len", "64", "--no-progress"]


class Load:
    """Spinners on every core for one run: none ('quiet'), coming and going ('flicker') or arriving late and
    staying ('late', once `events/rank0.jsonl` of `run_dir` holds training step `late`)."""

    def __init__(self, kind: str, run_dir: str, late: int, seed: int):
        self.kind, self.run_dir, self.late, self.rng = kind, run_dir, late, random.Random(seed)
        self.procs: list = []
        self.on_at: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=getattr(self, f"_{kind}"), daemon=True)

    def __enter__(self):
        if self.kind != "quiet":
            self.procs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)
            ]
            self._signal(signal.SIGSTOP)
        self.thread.start()
        return self

    def _signal(self, sig) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, sig)

    def _quiet(self) -> None:
        pass

    def _flicker(self) -> None:
        on = False
        while not self.done.wait(self.rng.uniform(0.5, 3.0)):
            on = not on
            self._signal(signal.SIGCONT if on else signal.SIGSTOP)

    def _late(self) -> None:
        path = os.path.join(self.run_dir, "events", "rank0.jsonl")
        while not self.done.wait(0.1):
            try:
                with open(path) as f:
                    if any(e.get("kind") == "step" and e.get("step") == self.late for e in map(_event, f)):
                        break
            except OSError:
                continue
        if not self.done.is_set():
            self.on_at = time.time()
            self._signal(signal.SIGCONT)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self._signal(signal.SIGCONT)
        for p in self.procs:
            p.kill()
            p.wait()


def _event(line: str) -> dict:
    try:
        e = json.loads(line)
    except ValueError:  # the line being written
        return {}
    return e if isinstance(e, dict) else {}


def parse(out: str) -> dict:
    """The breakdown's rows as dtlab run printed them: {row: value in ms (a fraction for overlap), or None for a
    row without a figure ('noise', 'n/a')}, the lines themselves, and the machine line where there is one."""
    figs, lines = {}, {}
    for line in out.splitlines():
        m = re.match(r"^  (T_step|T_comp|T_comm|exposed|overlap)\s+(\S+)", line)
        if m:
            try:
                figs[m.group(1)] = float(m.group(2))
            except ValueError:
                figs[m.group(1)] = None
            lines[m.group(1)] = line.strip()
    machine = next((ln.strip() for ln in out.splitlines() if ln.strip().startswith("machine:")), None)
    return {"figures": figs, "lines": lines, "machine": machine}


def impossible(p: dict) -> list:
    """What a breakdown printed as a figure that cannot be: a negative exposed time, an overlap outside [0, 1]."""
    f = p["figures"]
    bad = []
    if f.get("exposed") is not None and f["exposed"] < 0:
        bad.append(f"exposed {f['exposed']} ms")
    if f.get("overlap") is not None and not 0 <= f["overlap"] <= 1:
        bad.append(f"overlap {f['overlap']}")
    return bad


def one_run(kind: str, i: int, root: str, src: str | None, late: int) -> dict:
    out = os.path.join(root, f"{kind}{i}")
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    t0 = time.time()
    with Load(kind, out, late, seed=i) as load:
        cp = subprocess.run(
            [sys.executable, "-m", "dtlab", *MAIN_JOB, "--out", out],
            capture_output=True,
            text=True,
            env=env,
            cwd=src or None,
        )
    p = parse(cp.stdout)
    f = p["figures"]
    said_noise = "noise" in (p["lines"].get("exposed") or "")
    return {
        "load": kind,
        "run": i,
        "rc": cp.returncode,
        "wall_s": round(time.time() - t0, 1),
        "load_at_s": round(load.on_at - t0, 1) if load.on_at else None,
        **{k: f.get(k) for k in ROWS},
        "impossible": impossible(p),
        "comp_above_step": (f.get("T_comp") or 0) > (f.get("T_step") or 0),
        "said_noise": said_noise,
        "machine": p["machine"],
        "lines": p["lines"],
        "out": out,
        "stderr_tail": cp.stderr[-500:] if cp.returncode else "",
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per load")
    ap.add_argument("--loads", default="quiet,flicker,late")
    ap.add_argument("--late", type=int, default=4, help="'late' load arrives once training step LATE is done")
    ap.add_argument("--src", default=None, help="run the dtlab in this checkout (default: the installed one)")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    a = ap.parse_args()
    loads = a.loads.split(",")
    root = tempfile.mkdtemp(prefix="dtlab-busy-")
    runs = []
    for i in range(a.runs):
        for kind in loads if i % 2 == 0 else loads[::-1]:
            r = one_run(kind, i, root, a.src, a.late)
            runs.append(r)
            print(
                f"{kind:8s} #{i}: "
                + "  ".join(f"{k} {r[k] if r[k] is not None else '-'}" for k in ROWS)
                + f"  impossible {r['impossible'] or 'none'}  rc {r['rc']}  {r['wall_s']} s",
                flush=True,
            )
            if r["machine"]:
                print(f"            {r['machine']}", flush=True)
    quiet = [r["T_comp"] for r in runs if r["load"] == "quiet" and r["T_comp"] is not None]
    ref = statistics.median(quiet) if quiet else None
    print(
        f"\n{'load':8s} {'runs':>4s} {'impossible':>10s} {'T_comp>T_step':>13s} {'...said noise':>13s} "
        f"{'T_comp - quiet (ms, median; range)':>36s}"
    )
    for kind in loads:
        rs = [r for r in runs if r["load"] == kind]
        above = [r for r in rs if r["comp_above_step"]]
        moved = [r["T_comp"] - ref for r in rs if ref is not None and r["T_comp"] is not None]
        shift = f"{statistics.median(moved):+.0f} ({min(moved):+.0f} .. {max(moved):+.0f})" if moved else "-"
        print(
            f"{kind:8s} {len(rs):4d} {sum(bool(r['impossible']) for r in rs):10d} {len(above):13d} "
            f"{sum(r['said_noise'] for r in above):13d} {shift:>36s}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "quiet_t_comp_ms": ref, "args": vars(a)}, f, indent=2)


if __name__ == "__main__":
    main()
