"""Fault drills on the tiny model with 2 gloo ranks: the rank that caused a failure is named (not the survivor
that lost its peer), a frozen rank is caught by the watchdog in seconds with its stack in its log, an
interrupt stops every rank within 5 s, launches started together never share a port or a directory, bad
input never starts anything, and no rank PID outlives the call that reported the failure.

Faults are injected with DTLAB_FAULT="RANK:STEP:MODE" (dtlab.rank.lifecycle.maybe_inject_fault): the rank hurts
itself at the start of that step, which is deterministic where racing a `kill` from the test is not."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import dtlab
from dtlab.results.run import load_run

STALL_S = 4.0


DRILLS = {  # name: DTLAB_FAULT. Launched together, so they also drill simultaneous launches.
    "kill": "1:2:kill",  # SIGKILL, as kill -9 or the OOM killer: rank 0 then fails with "Connection reset"
    "raise": "0:2:raise",  # rank 0 this time: the culprit is not always the higher rank
    "stop": "1:2:stop",  # SIGSTOP: alive, silent, holding rank 0 in its all-reduce
}


#: where a rank frozen at its injected fault can be: the injection itself, or the step code just after it (the DDP
#: strategy's loop and step, the recorder's step clock, the marks it takes), as the stack's top frame prints it
STEP_CODE = r"maybe_inject_fault|(loop|bases|data_parallel|data|ddp|recorder|marks)\.py:\d+ in \w+"


def _loop_lines() -> set[int]:
    """The lines of dtlab/rank/loop.py's `run` where a rank stands between the injection and its step: the
    injection's call and the step's, the only lines of `run` a frozen rank's innermost dtlab frame may name."""
    src = open(os.path.join(os.path.dirname(dtlab.__file__), "rank", "loop.py")).read().splitlines()
    lines = {i + 1 for i, ln in enumerate(src) if "maybe_inject_fault(ctx.rank, step)" in ln or "loop.one(" in ln}
    assert len(lines) == 2, lines
    return lines


def _innermost_dtlab_frame(first: str) -> str:
    """The innermost dtlab frame of a stalled rank's message ("stack top: X" or "stack top: X (in dtlab: Y)")."""
    m = re.search(r"stack top: (\S+:\d+ in [\w<>]+)(?: \(in dtlab: (\S+:\d+ in [\w<>]+)\))?", first)
    assert m, first
    return m[2] or m[1]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead for our purposes
    except OSError:
        return False


def _start_events(run_dir):
    return [
        json.loads(line)
        for r in (0, 1)
        if os.path.exists(p := os.path.join(run_dir, "events", f"rank{r}.jsonl"))
        for line in open(p).read().splitlines()
        if json.loads(line).get("kind") == "start"
    ]


@pytest.fixture(scope="module")
def drills(tmp_path_factory):
    """{name: (handle, RunFailed, rank PIDs alive right after the raise, seconds the wait took)}."""
    root = tmp_path_factory.mktemp("drills")
    old = os.environ.get("DTLAB_FAULT")
    handles = {}
    try:
        for name, spec in DRILLS.items():
            os.environ["DTLAB_FAULT"] = spec  # launch() hands the environment to torchrun
            handles[name] = dtlab.launch(
                dtlab.tiny(
                    out=str(root / name),
                    steps=6,
                    stall_s=STALL_S if name == "stop" else None,
                    checkpoint_every=2 if name == "kill" else 0,
                )
            )
    finally:
        os.environ.pop("DTLAB_FAULT") if old is None else os.environ.update(DTLAB_FAULT=old)
    out = {}
    for name, h in handles.items():
        t0 = time.monotonic()
        with pytest.raises(dtlab.RunFailed) as info:
            h.wait(progress=False)
        waited = time.monotonic() - t0
        pids = [e["pid"] for e in _start_events(h.run_dir)]
        assert len(pids) == 2
        out[name] = (h, info.value, [p for p in pids if _alive(p)], waited)
    return out


def test_kill_9_names_the_rank_that_died_not_the_survivor(drills):
    h, e, alive, _ = drills["kill"]
    assert (e.state, e.rank, e.signal, e.exitcode) == ("failed", 1, "SIGKILL", -9)
    first = str(e).splitlines()[0]
    assert first.startswith("rank 1 died from signal SIGKILL") and "without recording an error" in first
    # rank 0 did fail ("Connection reset by peer"), but only as a consequence
    assert [c["rank"] for c in e.consequences] == [0]
    assert "rank 0" in first.split("As a consequence")[1]
    assert "--- logs/rank1.log" in str(e) and "injecting fault 'kill'" in e.log_tail
    assert not alive and h.proc.poll() is not None
    assert json.load(open(os.path.join(h.run_dir, "exits.json")))["1"]["signal"] == "SIGKILL"
    run = load_run(h.run_dir)
    assert run.status["state"] == "failed"
    # checkpoints on, max_restarts 0 (dtlab.results.restarts): step-2 was written before the kill, and nothing restarted
    assert os.path.isfile(os.path.join(h.run_dir, "checkpoints", "step-2", ".metadata")) and run.restarts.empty


def test_rank_that_raises_is_named_with_its_traceback(drills):
    h, e, alive, _ = drills["raise"]
    assert (e.state, e.rank, e.signal) == ("failed", 0, None)
    assert "injected fault" in e.error and "RuntimeError" in e.traceback_tail
    assert str(e).startswith("rank 0 failed: RuntimeError: injected fault")
    assert all(c["rank"] == 1 for c in e.consequences)
    run = load_run(h.run_dir)
    assert set(run.steps[run.steps["rank"] == 0]["step"]) == {0, 1}  # what rank 0 did before it raised
    assert not run.buckets.empty and not alive


def test_frozen_rank_is_caught_by_the_watchdog_with_its_stack(drills):
    h, e, alive, waited = drills["stop"]
    assert (e.state, e.rank, e.ranks, e.signal) == ("stalled", 1, [1], "SIGSTOP")
    first = str(e).splitlines()[0]
    assert first.startswith("rank 1 stalled: no event for") and f"stall_s={STALL_S:g} s" in first
    # where it was: last step, stack top. The frozen rank's stack is dumped as it resumes; it names the injection
    # (maybe_inject_fault) or, when the handler runs just after that call returned, the next lines of the step:
    # the rank loop's own (dtlab.rank.loop), the DDP step's (strategies/bases.py, ddp.py), the batch it
    # takes (dtlab.rank.data) or the step clock's marks they call
    assert "after step 1" in first and re.search(STEP_CODE, first)
    # and not merely the rank loop, which is in every stack: its innermost dtlab frame is the injection, the step
    # code below it, or `run` itself only at the injection's line or the step's
    where = _innermost_dtlab_frame(first)
    if where.startswith("loop.py:") and where.endswith(" in run"):
        assert int(where.split(":")[1].split()[0]) in _loop_lines(), where
    else:
        assert re.fullmatch(STEP_CODE.replace("maybe_inject_fault", r"lifecycle\.py:\d+ in maybe_inject_fault"), where)
    assert e.silent_s[1] >= STALL_S
    # caught in seconds: stall_s, then at most STACK_WAIT_S for the stacks and the stop
    assert STALL_S <= waited < STALL_S + 12
    # the stack of the frozen rank really landed in its log (SIGUSR1 then SIGCONT), and the waiting peer's too
    log1 = open(os.path.join(h.run_dir, "logs", "rank1.log")).read()
    assert "(most recent call first)" in log1 and re.search(
        r"in maybe_inject_fault|(loop|bases|data|ddp|recorder|marks)\.py\", line \d+ in \w+", log1
    )
    assert "(most recent call first)" in open(os.path.join(h.run_dir, "logs", "rank0.log")).read()
    assert [c["rank"] for c in e.consequences] == [0] and "waiting" in e.consequences[0]["how"]
    status = json.load(open(os.path.join(h.run_dir, "status.json")))
    assert status["state"] == "stalled" and status["stalled_ranks"] == [1]
    assert not alive  # the frozen rank too: a stopped process ignores SIGTERM until continued


def test_interrupt_stops_every_rank_within_5_s(tmp_path):
    """What a notebook's 'interrupt kernel' does: SIGINT to the process waiting in dtlab.run."""
    out = tmp_path / "interrupted"
    code = f"import dtlab; dtlab.run(dtlab.tiny(out={str(out)!r}, steps=10000, timeout_s=600), progress=False)"
    # SIGINT back to its default in the child: a shell's background job (how CI may start pytest) ignores it,
    # and Python then never raises KeyboardInterrupt; a notebook kernel does handle it
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    ev = out / "events" / "rank1.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (ev.exists() and '"kind": "step"' in ev.read_text()):
        time.sleep(0.2)  # wait until the ranks are training
    pids = [e["pid"] for e in _start_events(str(out))]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    while any(_alive(p) for p in pids) and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    gone_after = time.monotonic() - t0
    _, err = proc.communicate(timeout=60)
    assert gone_after < 5.0, f"ranks still alive {gone_after:.1f} s after the interrupt"
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"
    assert not load_run(str(out)).steps.empty  # what was recorded before the interrupt loads


def test_runs_and_a_calibration_started_together_never_collide(tmp_path, monkeypatch):
    """Default run directories (named by the second they start in) and rendezvous ports, under a race."""
    from dtlab.config.calibration import CalibConfig
    from dtlab.launching.calibration import launch_calibration

    monkeypatch.chdir(tmp_path)
    go = threading.Barrier(3)
    handles, errors = [None] * 3, []

    def start(i):
        try:
            go.wait()
            handles[i] = (
                launch_calibration(CalibConfig(nproc=2, sizes=(4096, 8192), iters=1, rounds=1, warmup=0))
                if i == 2
                else dtlab.launch(dtlab.tiny(steps=2, warmup=1))
            )
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    results = [h.wait(progress=False) for h in handles]  # all three finish
    assert len(results[2].samples) == 2  # the calibration's two sizes were timed
    dirs = {os.path.abspath(h.run_dir) for h in handles}
    assert len(dirs) == 3
    ports = [{e["master_port"] for e in _start_events(h.run_dir)} for h in handles]
    assert all(len(p) == 1 and 0 not in p for p in ports)  # the ranks of a run share one port...
    assert len(set.union(*ports)) == 3  # ...and no two runs share one
