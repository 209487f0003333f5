"""Who a run lives and dies with: a launch from a worker thread that exits runs on (the agent is tied to the
launching process, not to a thread); a launcher that dies takes its ranks with it, and its run is never read as
'running' afterwards ('abandoned', with what was recorded); a status whose processes are gone is judged by pid and
start time, on the host and boot that wrote it. Also the explicit small cases: OMP_NUM_THREADS=0 is refused, and a
calibration that did not finish says so when its profile is asked for."""

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time

import dtlab
from dtlab.cli.main import main as cli_main
from dtlab.results.run import load_run


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _starts(run_dir):
    out = []
    for r in (0, 1):
        p = os.path.join(run_dir, "events", f"rank{r}.jsonl")
        if os.path.exists(p):
            out += [json.loads(ln) for ln in open(p) if '"kind": "start"' in ln]
    return out


def test_a_launch_from_a_thread_that_exits_runs_to_the_end(tmp_path):
    """As a notebook helper might: launch in a worker thread, which goes on for a moment and then ends."""

    def start():
        h = dtlab.launch(dtlab.tiny(out=str(tmp_path / "threaded"), steps=4))
        time.sleep(1.0)  # the agent is up by now; with PR_SET_PDEATHSIG it got SIGTERM when this thread ended
        return h

    with cf.ThreadPoolExecutor(1) as pool:
        handle = pool.submit(start).result()
    # the pool's thread has exited here
    run = handle.wait(progress=False)
    assert run.status["state"] == "finished" and len(run.steps) == 2 * 4
    assert handle.proc.dtlab_lifeline is None  # the launcher's end of the lifeline was closed after the agent exited


def test_a_killed_launcher_takes_its_ranks_and_its_run_reads_abandoned(tmp_path, capsys):
    out = tmp_path / "orphaned"
    code = f"import dtlab; dtlab.run(dtlab.tiny(out={str(out)!r}, steps=100000, timeout_s=600), progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    ev = out / "events" / "rank1.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (ev.exists() and '"kind": "step"' in ev.read_text()):
        time.sleep(0.2)
    pids = [e["pid"] for e in _starts(str(out))]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    status = json.loads((out / "status.json").read_text())
    server = _ppid(status["agent"]["pid"])  # the warm agent server that forked the agent (a child of the launcher)
    assert _ppid(server) == proc.pid
    proc.send_signal(signal.SIGKILL)  # a kernel killed outright: no atexit, no finally
    proc.wait()
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "running" and status["launcher"]["pid"] == proc.pid  # nobody wrote an end state
    everyone = pids + [status["agent"]["pid"], server]
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in everyone) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in everyone if _alive(p)]  # the agent stopped them and went; so did the server
    run = load_run(str(out))
    assert run.status["state"] == "abandoned" and run.status["recorded_state"] == "running"
    assert f"the process that launched it (pid {proc.pid}) is gone" in run.status["why"]
    assert len(run.steps) > 0 and set(run.ranks["ended"]) == {"incomplete"}
    assert cli_main(["show", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "status abandoned" in printed and f"recorded: {len(run.steps)} steps" in printed
