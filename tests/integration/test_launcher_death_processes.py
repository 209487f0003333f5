"""A run's status judged against real processes: by pid and start time, a dead launcher reported by load_run, a node
whose launcher died abandoned. The rules without processes: tests/unit/test_launcher_death.py."""

import json
import os
import subprocess
import sys
import time

import psutil

from dtlab.results.liveness import identity, running_state
from dtlab.results.run import load_run


def _gone_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _run_dir(tmp_path, status, done=(0, 1)):
    (tmp_path / "events").mkdir(parents=True)
    cfg = {"strategy": "ddp", "nproc": 2, "warmup": 0, "bucket_mb": 1}
    (tmp_path / "config.json").write_text(json.dumps({"config": cfg}))
    for r in (0, 1):
        lines = [
            {"kind": "start", "rank": r, "pid": 1},
            {"kind": "step", "rank": r, "step": 0, "t_fwd": 0.1, "t_bwd": 0.1, "t_opt": 0.1, "t_step": 0.3},
        ]
        lines += [{"kind": "done", "rank": r}] if r in done else []
        (tmp_path / "events" / f"rank{r}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    (tmp_path / "status.json").write_text(json.dumps(status))
    return str(tmp_path)


def test_a_status_is_judged_by_pid_and_start_time(tmp_path):
    me = identity(os.getpid())
    dead = identity(_gone_pid())
    assert running_state({"state": "running", "agent": me}) is None  # alive
    assert running_state({"state": "running", "agent": dead})["state"] == "abandoned"
    reused = {**me, "start_ticks": me["start_ticks"] - 1}  # same pid, another process: the pid was reused
    assert running_state({"state": "running", "agent": reused})["state"] == "abandoned"
    assert (
        running_state({"state": "running", "agent": {**me, "boot_time": me["boot_time"] - 3600}})["state"]
        == "abandoned"
    )
    assert (
        running_state({"state": "running", "agent": {**dead, "host": "another-host"}}) is None
    )  # cannot tell from here
    assert running_state({"state": "running", "pid": dead["pid"]})["state"] == "abandoned"  # an older status: pid only
    # pid only, alive, but not torchrun's agent of this run (its command line does not name the run): reused
    assert running_state({"state": "running", "pid": os.getpid()}, str(tmp_path / "some-run"))["state"] == "abandoned"
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "some-run")])
    deadline = time.monotonic() + 30
    while str(tmp_path / "some-run") not in psutil.Process(agent.pid).cmdline():
        assert time.monotonic() < deadline
        time.sleep(0.01)  # until it has exec'd python
    try:  # one whose command line names the run, as torchrun's agent's does: running
        assert running_state({"state": "running", "pid": agent.pid}, str(tmp_path / "some-run")) is None
    finally:
        agent.kill()
        agent.wait()
    note = running_state({"state": "running", "agent": dead, "launcher": me})
    assert "state" not in note and f"launcher (pid {os.getpid()}) still runs" in note["note"]


def test_load_run_reports_a_dead_launcher(tmp_path):
    dead = identity(_gone_pid())
    d = _run_dir(tmp_path / "a", {"state": "running", "pid": dead["pid"], "agent": dead, "launcher": dead}, done=(0,))
    run = load_run(d)
    assert run.status["state"] == "abandoned" and f"(pid {dead['pid']}) is gone" in run.status["why"]
    assert "recorded: 2 steps (rank 0 up to step 0; rank 1 up to step 0)" in run.breakdown_table()
    # every rank recorded `done` before the launcher died: the results are whole
    d = _run_dir(tmp_path / "b", {"state": "running", "agent": dead, "launcher": dead})
    st = load_run(d).status
    assert st["state"] == "finished" and st["recorded_state"] == "running"
    # a live agent: still running
    d = _run_dir(tmp_path / "c", {"state": "running", "agent": identity(os.getpid())}, done=())
    assert load_run(d).status["state"] == "running"


def test_a_node_whose_launcher_died_is_abandoned(tmp_path):
    from dtlab.results.status import merged_status

    dead = identity(_gone_pid())
    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "node0.status.json").write_text(json.dumps({"state": "finished"}))
    (tmp_path / "nodes" / "node1.status.json").write_text(json.dumps({"state": "running", "agent": dead}))
    st = merged_status(str(tmp_path), 2)
    assert st["state"] == "abandoned" and st["nodes"]["1"]["state"] == "abandoned" and "node slot 1" in st["why"]
