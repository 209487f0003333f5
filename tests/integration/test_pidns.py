"""PID namespaces as the grading sandbox uses them, with real processes (dtlab.course.pidns): one that outlives its
deadline is ended, one that ends by itself is waited for."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from dtlab.course import pidns, sandbox

needs_pidns = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and util-linux's unshare for a pid namespace"
)


def _namespace_init(seconds: float):
    """A process that is pid 1 of a new pid namespace, sleeping `seconds`: (its pid here, its namespace's inode)."""
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", str(seconds)])
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            children = open(f"/proc/{outer.pid}/task/{outer.pid}/children").read().split()
        except OSError:
            children = []
        if children:
            pid = int(children[0])
            ns = os.readlink(f"/proc/{pid}/ns/pid")
            if ns != os.readlink("/proc/self/ns/pid"):
                return outer, pid, int(ns[len("pid:[") : -1])
        time.sleep(0.01)
    outer.kill()
    raise AssertionError("unshare started no process in a new pid namespace")


@needs_pidns
def test_a_namespace_that_outlives_the_deadline_is_ended():
    outer, pid, ns = _namespace_init(60)
    try:
        assert pidns.in_namespace(pid, ns)
        t0 = time.monotonic()
        assert pidns.emptied({"child-pid": pid, "pid-namespace": ns}, timeout_s=0.5) is False
        assert not pidns.in_namespace(pid, ns) and time.monotonic() - t0 < 30
    finally:
        outer.kill()
        outer.wait()


@needs_pidns
def test_a_namespace_that_ends_by_itself_is_waited_for_not_killed():
    outer, pid, ns = _namespace_init(0.5)
    try:
        assert pidns.emptied({"child-pid": pid, "pid-namespace": ns}, timeout_s=30) is True
        assert not pidns.in_namespace(pid, ns)
    finally:
        outer.wait()


LEAVE_BEHIND = "import subprocess; subprocess.Popen(['sleep', '86421.5'], start_new_session=True)"


def test_leaving_a_bwrap_sandbox_leaves_none_of_its_processes(monkeypatch):
    """A command that leaves a process behind in its own session: once `prepared` is left, it is gone, because
    leaving waited for the namespace bubblewrap reported (the window without the wait is too short for this test
    to see on a quiet machine, so the wait itself is checked)."""
    why = sandbox.probe("bwrap")
    if why is not None:
        pytest.skip(f"bubblewrap does not work here: {why}")
    waited = []
    monkeypatch.setattr(sandbox, "emptied", lambda info: waited.append(info) or pidns.emptied(info))
    with tempfile.TemporaryDirectory() as d:
        inbox, outbox = os.path.join(d, "in"), os.path.join(d, "out")
        os.makedirs(inbox)
        os.makedirs(outbox)
        os.chmod(d, 0o755)
        with sandbox.prepared("bwrap", [sys.executable, "-c", LEAVE_BEHIND], inbox, outbox) as (cmd, kw):
            assert subprocess.run(cmd, capture_output=True, timeout=60, cwd=d, **kw).returncode == 0
        left = []
        for p in os.listdir("/proc"):
            try:
                if p.isdigit() and b"86421.5" in open(f"/proc/{p}/cmdline", "rb").read():
                    left.append(p)
            except OSError:
                pass
        assert not left, f"left behind by the sandbox: pids {left}"
    assert len(waited) == 1 and waited[0]["child-pid"] > 1 and waited[0]["pid-namespace"] > 0, waited
