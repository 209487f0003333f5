"""The end of a bubblewrap sandbox (dtlab.course.pidns): bubblewrap exits as soon as the sandboxed command has,
while its pid namespace is still being torn down, so grading waits for the namespace to end (and ends it after a
deadline) before it reads and removes the outbox. Real pid namespaces, made with util-linux's unshare as root."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from dtlab.course import pidns, sandbox

needs_pidns = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and util-linux's unshare for a pid namespace"
)


def test_nothing_reported_is_nothing_to_wait_for_and_a_reused_pid_is_not_the_sandbox():
    assert pidns.emptied({}) is True
    own = int(os.readlink("/proc/self/ns/pid")[len("pid:[") : -1])
    assert pidns.in_namespace(os.getpid(), own) and not pidns.in_namespace(os.getpid(), own + 1)


def test_the_info_document_is_read_and_a_silent_bwrap_gives_none():
    r, w = os.pipe()
    os.write(w, b'{\n    "child-pid": 42,\n    "pid-namespace": 4026532178\n}\n')
    os.close(w)
    assert pidns.read_info(r) == {"child-pid": 42, "pid-namespace": 4026532178}
    os.close(r)
    r, w = os.pipe()
    os.close(w)
    assert pidns.read_info(r) == {}
    os.close(r)


def test_bwrap_is_asked_for_its_info_only_when_given_a_descriptor():
    cmd = sandbox.command("bwrap", ["true"], "/x/in", "/x/out", uid=2_000_000_123, info_fd=9)
    assert cmd[:3] == ["bwrap", "--info-fd", "9"]
    assert "--info-fd" not in sandbox.command("bwrap", ["true"], "/x/in", "/x/out", uid=2_000_000_123)


LEAVE_BEHIND = "import subprocess; subprocess.Popen(['sleep', '86421.5'], start_new_session=True)"


@pytest.mark.skipif(sandbox.probe("bwrap") is not None, reason="bubblewrap does not work here")
def test_leaving_a_bwrap_sandbox_leaves_none_of_its_processes(monkeypatch):
    """A command that leaves a process behind in its own session: once `prepared` is left, it is gone, because
    leaving waited for the namespace bubblewrap reported (the window without the wait is too short for this test
    to see on a quiet machine, so the wait itself is checked)."""
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
