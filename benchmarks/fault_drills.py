"""Fault drills: is the right rank named, how fast, and is anything left behind? Not a test: it prints a table.

Each fault is injected N times into a 2-rank gloo run of the tiny model with DTLAB_FAULT="RANK:STEP:MODE" (the
rank hurts itself at the start of that step, see dtlab.rank.lifecycle.maybe_inject_fault) and the launcher's answer is
timed from the moment of the fault (the time the rank printed just before hurting itself) to the moment
RunFailed reached the caller:

- kill: SIGKILL (kill -9, the OOM killer); segv: SIGSEGV (a native crash); exit: os._exit(3); raise: a Python
  exception; stop: SIGSTOP (a frozen rank: the watchdog, with --stall-s); interrupt: SIGINT to a process
  waiting in dtlab.run (a notebook's "interrupt kernel"), timed until every rank is gone.
- parallel: pairs of runs launched at the same instant with default run directories; a collision is a
  shared directory, a shared rendezvous port, or a run that did not finish.
- thread: dtlab.launch from a ThreadPoolExecutor worker that returns (and exits) 1 s later, then wait from the
  main thread; right = the run finished.
- launcher: SIGKILL to a process waiting in dtlab.run (a kernel that crashed), timed until every rank and the
  torchrun agent are gone; right = load_run then reads 'abandoned' and `dtlab show` exits 1.
- diskfull: the run directory on a 2 MiB tmpfs with 128 KiB left (needs root to mount); right = RunFailed whose
  error starts "disk full", status.json 'failed', no temporary file left, load_run works; timed from the last
  event line written to the raise.

Orphans are rank PIDs of the run still alive (not zombies) right after the call returned.

    python benchmarks/fault_drills.py --n 5 --pairs 20
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import dtlab

FAULTS = {  # name: (DTLAB_FAULT, rank that must be named, signal that must be named)
    "kill": ("1:2:kill", 1, "SIGKILL"),
    "segv": ("1:2:segv", 1, "SIGSEGV"),
    "exit": ("1:2:exit", 1, None),
    "raise": ("0:2:raise", 0, None),
    "stop": ("1:2:stop", 1, "SIGSTOP"),
}


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def start_events(run_dir):
    out = []
    for r in (0, 1):
        p = os.path.join(run_dir, "events", f"rank{r}.jsonl")
        if os.path.exists(p):
            out += [json.loads(line) for line in open(p) if '"start"' in line]
    return out


def fault_time(run_dir, rank):
    text = open(os.path.join(run_dir, "logs", f"rank{rank}.log"), errors="replace").read()
    m = re.search(r"injecting fault .* time (\d+\.\d+)", text)
    return float(m.group(1)) if m else None


def drill(name, root, i, stall_s):
    spec, rank, sig = FAULTS[name]
    os.environ["DTLAB_FAULT"] = spec
    try:
        h = dtlab.launch(
            dtlab.tiny(out=os.path.join(root, f"{name}{i}"), steps=6, stall_s=stall_s if name == "stop" else None)
        )
    finally:
        del os.environ["DTLAB_FAULT"]
    try:
        h.wait(progress=False)
        e = None
    except dtlab.RunFailed as err:
        e = err
    t_raised = time.time()
    orphans = [p for p in (ev["pid"] for ev in start_events(h.run_dir)) if alive(p)]
    t_fault = fault_time(h.run_dir, rank)
    right = e is not None and e.rank == rank and e.ranks == [rank] and e.signal == sig
    return {
        "survived": e is not None,
        "seconds": t_raised - t_fault if t_fault else float("nan"),
        "right": right,
        "orphans": len(orphans),
        "named": None if e is None else (e.rank, e.signal),
    }


def interrupt(root, i):
    out = os.path.join(root, f"interrupt{i}")
    code = f"import dtlab; dtlab.run(dtlab.tiny(out={out!r}, steps=100000, timeout_s=600), progress=False)"
    # SIGINT back to its default in the child: in a background job it is ignored, and Python would then
    # never raise KeyboardInterrupt (a notebook kernel does handle it)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    ev = os.path.join(out, "events", "rank1.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(ev) and '"kind": "step"' in open(ev).read()):
        time.sleep(0.1)
    pids = [e["pid"] for e in start_events(out)]
    assert len(pids) == 2, f"expected 2 rank PIDs before the interrupt, got {pids}"
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    while any(alive(p) for p in pids) and time.time() - t0 < 60:
        time.sleep(0.02)
    gone = time.time() - t0
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()  # not interrupted: the launcher's own stop then never ran; record it as a failed drill
        proc.wait()
    state = json.load(open(os.path.join(out, "status.json")))["state"]
    return {
        "survived": proc.returncode != 0 and state == "interrupted",
        "seconds": gone,
        "right": state == "interrupted",
        "orphans": sum(alive(p) for p in pids),
        "named": state,
    }


def parallel_pair(root, i):
    cwd = os.path.join(root, f"pair{i}")
    os.makedirs(cwd)
    os.chdir(cwd)  # default run directories: runs/<name>-<second>, the ones that can collide
    go = threading.Barrier(2)
    handles, results = [None, None], [None, None]

    def one(k):
        go.wait()
        handles[k] = dtlab.launch(dtlab.tiny(steps=2, warmup=1))
        try:
            handles[k].wait(progress=False)
            results[k] = "finished"
        except dtlab.RunFailed as e:
            results[k] = str(e).splitlines()[0]

    t0 = time.time()
    threads = [threading.Thread(target=one, args=(k,)) for k in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    dirs = {os.path.abspath(h.run_dir) for h in handles}
    ports = [{e["master_port"] for e in start_events(h.run_dir)} for h in handles]
    ok = results == ["finished", "finished"] and len(dirs) == 2 and not (ports[0] & ports[1])
    orphans = sum(alive(e["pid"]) for h in handles for e in start_events(h.run_dir))
    return {
        "survived": ok,
        "seconds": time.time() - t0,
        "right": ok,
        "orphans": orphans,
        "named": (results, sorted(dirs), ports),
    }


def threaded(root, i):
    import concurrent.futures as cf

    def start():
        h = dtlab.launch(dtlab.tiny(out=os.path.join(root, f"thread{i}"), steps=4))
        time.sleep(1.0)
        return h

    t0 = time.time()
    with cf.ThreadPoolExecutor(1) as pool:
        h = pool.submit(start).result()
    try:
        h.wait(progress=False)
        state = "finished"
    except dtlab.RunFailed as e:
        state = f"{e.state}: {str(e).splitlines()[0][:120]}"
    orphans = sum(alive(e["pid"]) for e in start_events(h.run_dir))
    return {
        "survived": True,
        "seconds": time.time() - t0,
        "right": state == "finished",
        "orphans": orphans,
        "named": state,
    }


def launcher_killed(root, i):
    out = os.path.join(root, f"launcher{i}")
    code = f"import dtlab; dtlab.run(dtlab.tiny(out={out!r}, steps=100000, timeout_s=600), progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    ev = os.path.join(out, "events", "rank1.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(ev) and '"kind": "step"' in open(ev).read()):
        time.sleep(0.1)
    agent = json.load(open(os.path.join(out, "status.json")))["agent"]["pid"]
    pids = [e["pid"] for e in start_events(out)] + [agent]
    t0 = time.time()
    proc.kill()
    proc.wait()
    while any(alive(p) for p in pids) and time.time() - t0 < 120:
        time.sleep(0.02)
    gone = time.time() - t0
    state = dtlab.load_run(out).status["state"]
    rc = subprocess.run([sys.executable, "-m", "dtlab", "show", out], capture_output=True).returncode
    return {
        "survived": True,
        "seconds": gone,
        "right": state == "abandoned" and rc == 1,
        "orphans": sum(alive(p) for p in pids),
        "named": (state, rc),
    }


def disk_full(root, i):
    mnt = os.path.join(root, f"fs{i}")
    os.makedirs(mnt)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", mnt]).returncode:
        raise SystemExit("diskfull: cannot mount a tmpfs (needs root)")
    try:
        st = os.statvfs(mnt)
        with open(os.path.join(mnt, "filler"), "wb") as f:
            f.write(b"\0" * (st.f_bfree * st.f_frsize - 128 * 1024))
        out = os.path.join(mnt, "run")
        try:
            dtlab.run(dtlab.tiny(out=out, steps=100000, timeout_s=300), progress=False)
            e = None
        except dtlab.RunFailed as err:
            e = err
        t_raised = time.time()
        t_last = max(os.path.getmtime(os.path.join(out, "events", n)) for n in os.listdir(os.path.join(out, "events")))
        temps = [n for _, _, files in os.walk(mnt) for n in files if ".tmp" in n]
        state = json.load(open(os.path.join(out, "status.json")))["state"]
        steps = len(dtlab.load_run(out).steps)
        right = e is not None and e.error.startswith("disk full") and state == "failed" and not temps and steps > 0
        return {
            "survived": e is not None,
            "seconds": t_raised - t_last,
            "right": right,
            "orphans": sum(alive(ev["pid"]) for ev in start_events(out)),
            "named": (e.error[:90] if e else None, state, f"{steps} steps loaded", temps),
        }
    finally:
        subprocess.run(["umount", "-l", mnt])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5, help="repetitions of each fault (default 5)")
    ap.add_argument("--pairs", type=int, default=None, help="parallel launch pairs (default: --n)")
    ap.add_argument("--stall-s", type=float, default=3.0, help="stall_s for the frozen-rank drill (default 3)")
    ap.add_argument(
        "--only",
        default=None,
        help="comma list of drills (kill,segv,exit,raise,stop,interrupt,parallel,thread,launcher,diskfull)",
    )
    ap.add_argument("--json", default=None, help="write the raw results here")
    a = ap.parse_args()
    names = list(FAULTS) + ["interrupt", "parallel", "thread", "launcher", "diskfull"]
    extra = {"thread": threaded, "launcher": launcher_killed, "diskfull": disk_full}
    if a.only:
        names = [n for n in names if n in a.only.split(",")]
    root = tempfile.mkdtemp(prefix="dtlab-faults-")
    home = os.getcwd()
    rows = {}
    for name in names:
        reps = (a.pairs or a.n) if name == "parallel" else a.n
        rows[name] = []
        for i in range(reps):
            if name in FAULTS:
                r = drill(name, root, i, a.stall_s)
            elif name == "interrupt":
                r = interrupt(root, i)
            elif name in extra:
                r = extra[name](root, i)
            else:
                r = parallel_pair(root, i)
                os.chdir(home)
            rows[name].append(r)
            print(
                f"{name:9s} #{i}: survived={r['survived']} right={r['right']} {r['seconds']:.2f} s "
                f"orphans={r['orphans']} named={r['named']}",
                flush=True,
            )
    what = {
        "kill": "SIGKILL rank 1 at step 2",
        "segv": "SIGSEGV rank 1 at step 2",
        "exit": "os._exit(3) rank 1",
        "raise": "rank 0 raises at step 2",
        "stop": f"SIGSTOP rank 1 (stall_s={a.stall_s:g})",
        "interrupt": "SIGINT to the waiting process",
        "parallel": "2 runs launched together",
        "thread": "launch from a worker thread that exits",
        "launcher": "SIGKILL to the launching process",
        "diskfull": "run directory on a full 2 MiB tmpfs",
    }
    timing = {
        "interrupt": "SIGINT -> all ranks gone",
        "parallel": "pair wall time",
        "thread": "launch -> finished",
        "launcher": "SIGKILL -> ranks and agent gone",
        "diskfull": "last event written -> RunFailed",
    }
    print(
        "\n| drill | runs | survived (RunFailed / clean) | named correctly | time, median [max] | what is timed "
        "| orphans |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rs in rows.items():
        secs = [r["seconds"] for r in rs if r["seconds"] == r["seconds"]]
        t = f"{statistics.median(secs):.2f} s [{max(secs):.2f}]" if secs else "n/a"
        print(
            f"| {name}: {what[name]} | {len(rs)} | {sum(r['survived'] for r in rs)}/{len(rs)} | "
            f"{sum(r['right'] for r in rs)}/{len(rs)} | {t} | {timing.get(name, 'fault -> RunFailed')} | "
            f"{sum(r['orphans'] for r in rs)} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2, default=str)


if __name__ == "__main__":
    main()
