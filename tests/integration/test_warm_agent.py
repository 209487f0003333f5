"""CPU runs whose torchrun agent is forked from a warm server (dtlab.launching.warm): one server per environment
serves every launch of this process, each agent is found, stopped and reported as a cold one is, and a server that
dies does not hang the runs it started."""

import json
import os
import signal
import time

import psutil

import dtlab
from dtlab.launching.torchrun import is_rank_of


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a for a in f.read().split(b"\0") if a]


def _live_ranks(handle, n: int, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = handle.live_rank_pids()
        if len(pids) == n:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"{n} ranks never showed up: {handle.live_rank_pids()}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _long(tmp_path, name):
    return dtlab.tiny(out=str(tmp_path / name), steps=100000, timeout_s=120.0)


def test_agents_of_one_environment_come_from_one_server_and_stop_like_cold_ones(tmp_path):
    servers = []
    for name in ("a", "b"):
        h = dtlab.launch(_long(tmp_path, name))
        ranks = _live_ranks(h, 2)
        servers.append(_ppid(h.proc.pid))
        argv = _cmdline(h.proc.pid)  # the agent's command line names its run and rank module, as a cold agent's
        assert argv[1:3] == [b"-c", b"dtlab warm agent"] and argv[-3:] == [
            b"-m",
            b"dtlab.rank.worker",
            h.run_dir.encode(),
        ], argv
        assert all(is_rank_of(p, h.run_dir) for p in ranks) and not is_rank_of(h.proc.pid, h.run_dir)
        h.stop(grace_s=10.0)
        assert h.status() == "stopped" and h.proc.returncode is not None
        assert not [p for p in ranks if _alive(p)] and not _alive(h.proc.pid)
    assert servers[0] == servers[1] and _alive(servers[0]) and servers[0] != os.getpid()


def test_a_killed_server_hangs_no_run_and_the_next_launch_gets_a_new_one(tmp_path):
    h = dtlab.launch(_long(tmp_path, "orphan"))
    ranks = _live_ranks(h, 2)
    server = _ppid(h.proc.pid)
    os.kill(server, signal.SIGKILL)
    h.stop(grace_s=10.0)  # the agent's exit can no longer be reported by its server: seen from /proc instead
    assert h.status() == "stopped" and not [p for p in ranks + [h.proc.pid] if _alive(p)]
    run = dtlab.run(dtlab.tiny(out=str(tmp_path / "after"), steps=2, baseline_steps=0), progress=False)
    assert run.status["state"] == "finished"
    with open(os.path.join(run.path, "events", "rank0.jsonl")) as f:
        start = json.loads(f.readline())
    assert start["kind"] == "start" and start["warm_agent"] is True


_NOT_READY = (
    "import json, socket, sys; socket.socket(fileno=int(sys.argv[1])).send("
    "json.dumps({'ready': False, 'error': 'imports failed'}).encode())"
)


def test_a_server_that_cannot_start_leaves_the_launch_to_a_cold_agent(tmp_path, monkeypatch):
    from dtlab.launching import warm

    monkeypatch.setattr(warm, "_SERVE", _NOT_READY)
    monkeypatch.setenv("WARM_AGENT_TEST", str(tmp_path))  # an environment no server has served yet
    runs = [
        dtlab.run(dtlab.tiny(out=str(tmp_path / f"cold{i}"), steps=2, baseline_steps=0), progress=False)
        for i in range(2)
    ]
    for run in runs:
        with open(os.path.join(run.path, "events", "rank0.jsonl")) as f:
            start = json.loads(f.readline())
        assert run.status["state"] == "finished" and start["warm_agent"] is False
    # the server that could not start is kept, marked unusable: the second launch did not start another
    assert sum(1 for k in warm._SERVERS if dict(k[2]).get("WARM_AGENT_TEST") == str(tmp_path)) == 1


def test_ranks_are_forked_by_a_zygote_that_has_one_thread_and_dies_with_the_agent(tmp_path):
    """Forking from a process with threads copies any lock another thread holds, held for good; the zygote is forked
    from the agent before its first thread and starts none, and every rank is its child."""
    h = dtlab.launch(dtlab.tiny(out=str(tmp_path / "z"), nproc=3, steps=100000, timeout_s=120.0))
    ranks = _live_ranks(h, 3)
    zygotes = {_ppid(p) for p in ranks}
    assert len(zygotes) == 1
    zygote = zygotes.pop()
    assert _ppid(zygote) == h.proc.pid and not is_rank_of(zygote, h.run_dir)  # the agent's child, not a rank
    assert len(os.listdir(f"/proc/{zygote}/task")) == 1  # one thread, while the agent has several
    assert len(os.listdir(f"/proc/{h.proc.pid}/task")) > 1
    # the forkserver's resource tracker is the warm server's, started once: the agent started none of its own
    assert [c.pid for c in psutil.Process(h.proc.pid).children()] == [zygote]
    trackers = [c for c in psutil.Process(_ppid(h.proc.pid)).children() if "resource_tracker" in " ".join(c.cmdline())]
    assert len(trackers) == 1, trackers
    with open(tmp_path / "z" / "logs" / "torchrun.log") as f:
        assert f"ranks are forked by the zygote (pid {zygote}), forked from this agent with 1 thread(s)" in f.read()
    os.kill(h.proc.pid, signal.SIGKILL)  # the agent killed outright: the zygote, then its ranks, die with it
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in [zygote, *ranks]):
        assert time.monotonic() < deadline, [p for p in [zygote, *ranks] if _alive(p)]
        time.sleep(0.05)
    h.stop(grace_s=5.0)
