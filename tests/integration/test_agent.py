"""The agent's watch over forked ranks (dtlab.launching.agent._ExitWatch): every rank's end is recorded with its
exit code or signal, and the watch never reaps (torch's process context does), so both see the same end."""

import os
import signal
import time

from dtlab.launching.agent import _ExitWatch


def _child(watch, rank, how):
    pid = os.fork()
    if pid == 0:  # the child: report, then end as told (no Python teardown)
        try:
            watch.started(rank)
            time.sleep(0.2)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(how)
        finally:
            os._exit(99)
    return pid


def test_every_failed_rank_is_recorded_with_its_code_or_signal_and_left_for_the_reaper():
    watch = _ExitWatch()
    pids = {0: _child(watch, 0, 3), 1: _child(watch, 1, "kill"), 2: _child(watch, 2, 0)}
    deadline = time.monotonic() + 10
    while len(watch.ends) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    failed = watch.failures()
    assert set(failed) == {0, 1}  # rank 2 exited 0: not a failure
    assert (failed[0]["pid"], failed[0]["exitcode"], failed[0]["signal"]) == (pids[0], 3, None)
    assert (failed[1]["pid"], failed[1]["exitcode"], failed[1]["signal"]) == (pids[1], -9, "SIGKILL")
    # not reaped by the watch: the process's owner still collects each status
    assert os.waitpid(pids[0], 0)[1] >> 8 == 3
    assert os.WTERMSIG(os.waitpid(pids[1], 0)[1]) == signal.SIGKILL
    os.waitpid(pids[2], 0)


def test_only_the_latest_attempt_of_a_rank_counts():
    watch = _ExitWatch()
    old = _child(watch, 0, 1)  # a first attempt that failed (torchrun restarted the group)
    deadline = time.monotonic() + 10
    while old not in watch.ends and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watch.failures()[0]["pid"] == old
    new = _child(watch, 0, 0)  # the restarted rank 0 finished
    deadline = time.monotonic() + 10
    while new not in watch.ends and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watch.failures() == {}
    for pid in (old, new):
        os.waitpid(pid, 0)


def _stopped_rank(conn):  # a forked rank that computes until torch's agent SIGTERMs it (default handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    conn.send("started")
    while True:
        time.sleep(0.05)


def test_a_rank_reaped_by_torchs_process_context_before_the_watch_looked_is_still_recorded(monkeypatch):
    """On a busy machine torch's process context (is_alive, join: multiprocessing's fork Popen.poll) can reap a
    rank it SIGTERMed before the thread waiting on that PID has run; that thread then finds nothing. Here the rank
    is known to the watch without such a thread, so only the reaping path can record its end."""
    import multiprocessing
    from multiprocessing import popen_fork

    monkeypatch.setattr(popen_fork.Popen, "poll", popen_fork.Popen.poll)  # restored after the test
    watch = _ExitWatch()
    watch.watch_reaping()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_stopped_rank, args=(child,))
    proc.start()
    assert parent.recv() == "started"
    watch.pids[0] = proc.pid  # as the watch's pipe reader does, but with no waiting thread for this PID
    os.kill(proc.pid, signal.SIGTERM)  # as torch's agent stops the survivors
    proc.join(10)
    assert proc.exitcode == -signal.SIGTERM  # reaped by multiprocessing, as torch does
    end = watch.failures()[0]
    assert (end["pid"], end["exitcode"], end["signal"]) == (proc.pid, -15, "SIGTERM")
