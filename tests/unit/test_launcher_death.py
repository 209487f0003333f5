"""Who a run lives and dies with: a launch from a worker thread that exits runs on (the agent is tied to the
launching process, not to a thread); a launcher that dies takes its ranks with it, and its run is never read as
'running' afterwards ('abandoned', with what was recorded); a status whose processes are gone is judged by pid and
start time, on the host and boot that wrote it. Also the explicit small cases: OMP_NUM_THREADS=0 is refused, and a
calibration that did not finish says so when its profile is asked for."""

import json
import os
import subprocess
import sys
import time

import pandas as pd
import psutil
import pytest

import dtlab
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


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_omp_num_threads_that_is_not_a_positive_number_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ValueError, match=rf"OMP_NUM_THREADS must be a whole number >= 1 .*got {value!r}"):
        dtlab.launch(dtlab.tiny(out=str(tmp_path / "never")))
    assert not (tmp_path / "never").exists()


def _calibration_dir(tmp_path, state):
    (tmp_path / "events").mkdir()
    cal = {"nproc": 2, "ops": ["all_reduce"], "rounds": 3, "iters": 3, "form": "ring", "nnodes": 1}
    (tmp_path / "config.json").write_text(json.dumps({"calibration": cal, "resolved": {"world_size": 2}}))
    for r in (0, 1):
        ev = [{"kind": "start", "rank": r, "pid": 1}]
        ev += [
            {
                "kind": "sample",
                "rank": r,
                "op": "all_reduce",
                "nbytes": n,
                "nproc": 2,
                "iter": i,
                "seconds": 1e-4 + n * 1e-9 + i * 1e-6,
            }
            for n in (4096, 65536, 1 << 20)
            for i in range(2)
        ]
        ev += [{"kind": "calib", "rank": r, "round": 0, "rounds": 3}]
        (tmp_path / "events" / f"rank{r}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (tmp_path / "status.json").write_text(json.dumps({"state": state}))
    return str(tmp_path)


def test_an_interrupted_calibration_says_so(tmp_path):
    from dtlab.results.calibration import load_calibration

    d = _calibration_dir(tmp_path, "interrupted")
    with pytest.raises(dtlab.RunFailed) as info:
        dtlab.load_profile(d)
    e = info.value
    assert e.state == "interrupted" and "was interrupted before it finished" in str(e)
    assert "12 rank samples recorded, 1 of 3 rounds done" in str(e) and "partial=True" in str(e)
    with pytest.raises(dtlab.RunFailed) as info:
        load_calibration(d)
    assert info.value.state == "interrupted" and isinstance(info.value.run, pd.DataFrame)
    prof = load_calibration(d, partial=True)  # what was recorded, fitted and labelled
    assert prof.meta["partial"] and "all_reduce" in prof.fits
    assert any(c.startswith("partial: the sweep interrupted") for c in prof.caveats)
    assert dtlab.load_profile(d).meta["partial"]  # the partial profile was saved


@pytest.mark.parametrize("value", ["forkserver", "Fork", "x"])
def test_a_start_method_other_than_fork_or_spawn_is_refused_before_anything_starts(tmp_path, monkeypatch, value):
    monkeypatch.setenv("DTLAB_START_METHOD", value)
    with pytest.raises(ValueError, match=rf"DTLAB_START_METHOD must be one of fork, spawn, got {value!r}"):
        dtlab.launch(dtlab.tiny(out=str(tmp_path / "never")))
    assert not (tmp_path / "never").exists()


def test_nccl_ranks_are_always_spawned_and_gloo_ranks_forked_unless_asked(monkeypatch):
    from dtlab.launching.agent import start_method

    assert start_method(True, {}) == "fork" and start_method(True, {"DTLAB_START_METHOD": "spawn"}) == "spawn"
    assert start_method(False, {}) == "spawn" and start_method(False, {"DTLAB_START_METHOD": "fork"}) == "spawn"
