"""Launch stress: every strategy at 2 to 4 ranks, launched again and again from several processes at once (as
notebooks on one node do), with a CPU hog beside them. Counts launches and hangs, and the time from the launch call
to the first step.

Each worker is its own Python process (a notebook kernel's stand-in, with its own warm agent server) running
launches of the tiny model one after another, the strategy and rank count drawn from a seeded list. A launch's
first-step latency is the wall time from the `dtlab.launch` call until every rank's event file holds a step (the
launcher's view, polled every 20 ms). A launch whose ranks have not all stepped within `--hang-s` seconds is a hang:
every live rank is asked for its Python stacks (SIGUSR1: faulthandler writes them into its log), the run directory
is copied to OUT/hangs/ with every thread's native stack of the agent and each rank (gdb, where installed), and the
run is stopped. A launch that fails otherwise is counted apart with its error.

The hog is one process spinning on the CPU at nice 10 (a student's busy notebook), for the whole stress.
Not a test: it prints the figures docs/benchmarks.md quotes, and writes every launch as one JSON line to
OUT/launches.jsonl.

    python benchmarks/launch_stress.py --workers 2 --minutes 30 --out /tmp/stress
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from multiprocessing import resource_tracker

SHAPES = [(s, n, {}) for s in ("ddp", "ps", "zero3", "fsdp2", "tp", "pp", "async") for n in (2, 3, 4)]
SHAPES += [("tp", 4, {"dp_degree": 2}), ("pp", 4, {"dp_degree": 2})]  # the tiny model has 2 layers and 2 heads


def _all_stepped(run_dir: str, nproc: int) -> bool:
    for r in range(nproc):
        path = os.path.join(run_dir, "events", f"rank{r}.jsonl")
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError:
            return False
        if b'"kind": "step"' not in text and b'"kind": "update"' not in text and b'"kind": "baseline_step"' not in text:
            return False
    return True


def _configs(seed: int):
    """Valid (strategy, nproc) configs in a seeded order, forever."""
    import dtlab

    valid = []
    for strategy, nproc, extra in SHAPES:
        try:
            dtlab.tiny(strategy=strategy, nproc=nproc, steps=2, **extra).validate()
        except ValueError:
            continue
        valid.append((strategy, nproc, extra))
    rng = random.Random(seed)
    while True:
        yield rng.choice(valid)


def worker(index: int, out: str, deadline: float, hang_s: float, seed: int) -> None:
    """One worker process: launch until the deadline, one JSON line per launch on stdout."""
    import dtlab
    from dtlab.results.status import RunFailed

    runs = os.path.join(out, "runs", f"w{index}")
    os.makedirs(runs, exist_ok=True)
    for n, (strategy, nproc, extra) in enumerate(_configs(seed * 1000 + index)):
        if time.time() > deadline:
            return
        cfg = dtlab.tiny(strategy=strategy, nproc=nproc, steps=2, timeout_s=hang_s + 120, out=f"{runs}/{n}", **extra)
        rec = {"worker": index, "n": n, "strategy": strategy, "nproc": nproc, "t": time.time()}
        t0 = time.monotonic()
        h = dtlab.launch(cfg)
        while not _all_stepped(h.run_dir, nproc) and h.status() == "running":
            if time.monotonic() - t0 > hang_s:
                break
            time.sleep(0.02)
        stepped = _all_stepped(h.run_dir, nproc)
        rec["first_step_s"] = time.monotonic() - t0 if stepped else None
        if not stepped and h.status() == "running":  # a hang before the first step
            pids = h.live_rank_pids()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(3)
            dest = os.path.join(out, "hangs", f"w{index}-{n}-{strategy}-{nproc}")
            shutil.copytree(h.run_dir, dest, dirs_exist_ok=True)
            for pid in [h.proc.pid, *pids]:  # native stacks too, where gdb is installed: the lock a thread waits on
                with open(os.path.join(dest, f"native-{pid}.txt"), "w") as f:
                    f.write(native_stacks(pid))
            rec.update(hang=True, live_ranks=pids, saved=dest)
            h.stop(grace_s=5)
        else:
            try:
                h.wait(progress=False)
                rec["state"] = "finished"
            except RunFailed as e:
                rec.update(state=e.state, error=str(e)[:500])
            shutil.rmtree(h.run_dir, ignore_errors=True)
        print(json.dumps(rec), flush=True)


def native_stacks(pid: int) -> str:
    """Every thread's native stack of `pid` (gdb -batch) as text, under a "== pid" header; the header alone where
    gdb is missing (benchmarks/fork_lock.py uses it too)."""
    text = f"== pid {pid}\n"
    if shutil.which("gdb") is None:
        return text
    try:
        cp = subprocess.run(
            ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return text + cp.stdout + cp.stderr
    except subprocess.TimeoutExpired:
        return text + "gdb did not answer within 120 s\n"


def _hog() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import os\nos.nice(10)\nwhile True: pass"], stdout=subprocess.DEVNULL
    )


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _figures(recs: list[dict]) -> dict:
    # latencies leave out each worker's first launch, which also started its warm agent server (its imports)
    lat = [r["first_step_s"] for r in recs if r.get("first_step_s") is not None and r.get("n") != 0]
    return {
        "launches": len(recs),
        "hangs": sum(bool(r.get("hang")) for r in recs),
        "failed": sum(r.get("state") not in (None, "finished") for r in recs),
        "first_step_median_s": statistics.median(lat) if lat else None,
        "first_step_p95_s": _pct(lat, 0.95) if lat else None,
        "first_step_max_s": max(lat) if lat else None,
    }


def summary(*paths: str) -> dict:
    """Counts and first-step latencies (median, 95th percentile, slowest, s; a worker's first launch, which started
    its warm agent server too, counted but not timed) of OUT/launches.jsonl files, overall, by strategy and by
    strategy and rank count; the states and errors of failed launches."""
    recs = [json.loads(line) for path in paths for line in open(path) if line.strip()]
    out = _figures(recs)
    out["by_strategy"] = {
        s: _figures([r for r in recs if r["strategy"] == s]) for s in sorted({r["strategy"] for r in recs})
    }
    shapes = sorted({(r["strategy"], r["nproc"]) for r in recs})
    out["by_shape"] = {
        f"{s} {n}": _figures([r for r in recs if (r["strategy"], r["nproc"]) == (s, n)]) for s, n in shapes
    }
    out["failures"] = [
        {k: r.get(k) for k in ("strategy", "nproc", "state", "error")}
        for r in recs
        if r.get("state") not in (None, "finished")
    ]
    return out


# ---- what starting the ranks costs, one piece at a time ---------------------------------------------------------
MODES = {  # name -> (start method, resource tracker: 'agent' | 'early' | 'server', parallel requests to the zygote)
    "fork": ("fork", "agent", False),
    "zygote": ("forkserver", "agent", False),
    "zygote, tracker before it": ("forkserver", "early", False),
    "zygote, tracker in the server": ("forkserver", "server", False),
    "zygote, parallel requests": ("forkserver", "agent", True),
    "zygote, server's tracker, parallel": ("forkserver", "server", True),
}


def _up(i: int, w: int, queues, event) -> None:
    """A rank's stand-in: say it is up (one byte), then end."""
    os.write(w, b"x")


def _one_start(method: str, tracker: str, parallel: bool, nproc: int) -> dict:
    """In a forked agent's stand-in: start `nproc` ranks as torch's elastic agent does (a SimpleQueue each, an
    Event, torch.multiprocessing.start_processes), from this process or from a zygote; seconds until
    start_processes returned and until every rank said it was up, and this process's CPU seconds."""
    import torch.multiprocessing as tmp

    from dtlab.launching.agent import fork_zygote

    t0, c0 = time.perf_counter(), time.process_time()
    r, w = os.pipe()  # made before the zygote: its ranks inherit the write end
    if tracker == "early":
        resource_tracker.ensure_running()
    if method == "forkserver":
        fork_zygote()
    os.environ["TORCH_MP_PARALLEL_START"] = "1" if parallel else "0"
    ctx = multiprocessing.get_context(method)
    queues = {i: ctx.SimpleQueue() for i in range(nproc)}
    event = ctx.Event()
    t1 = time.perf_counter()
    pc = tmp.start_processes(_up, args=(w, queues, event), nprocs=nproc, join=False, start_method=method)
    t2 = time.perf_counter()
    got = b""
    while len(got) < nproc:
        got += os.read(r, nproc)
    t3 = time.perf_counter()
    cpu = time.process_time() - c0
    while not pc.join():
        pass
    return {"setup_s": t1 - t0, "started_s": t2 - t1, "up_s": t3 - t1, "total_s": t3 - t0, "agent_cpu_s": cpu}


def _agent(mode: str, nproc: int, out_w: int) -> None:
    """Fork an agent's stand-in for one round of `mode`; it writes its figures as one JSON line to `out_w`."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:  # the agent's main is `python -c` (no file), so a forkserver rank never runs it again (__mp_main__)
            sys.modules["__main__"].__dict__.pop("__file__", None)
            rec = _one_start(*MODES[mode], nproc)
            os.write(out_w, (json.dumps({"mode": mode, **rec}) + "\n").encode())
            code = 0
        finally:
            os._exit(code)
    os.waitpid(pid, 0)


def _server(nproc: int, req_r: int, out_w: int) -> None:
    """A warm server's stand-in that started the resource tracker once: forks an agent per mode it is sent."""
    resource_tracker.ensure_running()
    with os.fdopen(req_r) as reqs:
        for line in reqs:
            _agent(line.strip(), nproc, out_w)
    os._exit(0)


def start_cost(rounds: int, nproc: int, out: str) -> dict:
    """Every mode of MODES in turn, `rounds` times, each round an agent forked from this warmed process (or from a
    server forked from it that started the resource tracker): the cost of starting `nproc` ranks, side by side."""
    import torch.distributed.run  # noqa: F401 - what a warm server imports before it forks agents

    from dtlab.rank.data import warm_model

    warm_model()
    out_r, out_w = os.pipe()
    req_r, req_w = os.pipe()
    server = os.fork()
    if server == 0:
        os.close(req_w)
        _server(nproc, req_r, out_w)
    os.close(req_r)
    reqs = os.fdopen(req_w, "w", buffering=1)
    results = os.fdopen(out_r)
    recs = []
    for _ in range(rounds):
        for mode, (_, tracker, _) in MODES.items():
            if tracker == "server":
                reqs.write(mode + "\n")
            else:
                _agent(mode, nproc, out_w)
            recs.append(json.loads(results.readline()))
    reqs.close()
    os.waitpid(server, 0)
    with open(os.path.join(out, "start_cost.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    keys = ("setup_s", "started_s", "up_s", "total_s", "agent_cpu_s")
    return {
        m: {k + "_median_ms": round(1000 * statistics.median(r[k] for r in recs if r["mode"] == m), 2) for k in keys}
        for m in MODES
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="launching processes at once")
    ap.add_argument("--minutes", type=float, default=30.0, help="how long to keep launching")
    ap.add_argument("--hang-s", type=float, default=120.0, help="no first step by then = a hang (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hog", action="store_true", help="no CPU hog beside the launches")
    ap.add_argument(
        "--out",
        required=True,
        action="append",
        help="folder for launches.jsonl, hangs/ and runs/ (--summary: one or more, summarised together)",
    )
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--summary", action="store_true", help="only summarise OUT/launches.jsonl")
    ap.add_argument("--start-cost", type=int, default=0, metavar="ROUNDS", help="only time starting ranks, each way")
    ap.add_argument("--nproc", type=int, default=4, help="ranks per start in --start-cost")
    a = ap.parse_args()
    if a.summary:
        print(json.dumps(summary(*(os.path.join(o, "launches.jsonl") for o in a.out)), indent=2))
        return
    a.out = a.out[-1]
    if a.start_cost:
        os.makedirs(a.out, exist_ok=True)
        print(json.dumps(start_cost(a.start_cost, a.nproc, a.out), indent=2))
        return
    if a.worker is not None:
        worker(a.worker, a.out, a.deadline, a.hang_s, a.seed)
        return
    log = os.path.join(a.out, "launches.jsonl")
    os.makedirs(a.out, exist_ok=True)
    deadline = time.time() + a.minutes * 60
    hog = None if a.no_hog else _hog()
    cmd = [sys.executable, __file__, "--out", a.out, "--deadline", str(deadline), "--hang-s", str(a.hang_s)]
    try:
        with open(log, "a") as f:
            procs = [
                subprocess.Popen(cmd + ["--worker", str(i), "--seed", str(a.seed)], stdout=f) for i in range(a.workers)
            ]
            for p in procs:
                p.wait()
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    print(json.dumps(summary(log), indent=2))


if __name__ == "__main__":
    main()
