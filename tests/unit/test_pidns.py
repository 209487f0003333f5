"""The end of a bubblewrap sandbox (dtlab.course.pidns): bubblewrap exits as soon as the sandboxed command has,
while its pid namespace is still being torn down, so grading waits for the namespace to end (and ends it after a
deadline) before it reads and removes the outbox. What needs no process of its own; a real bubblewrap sandbox and
real pid namespaces are in tests/integration/test_pidns.py."""

import os

from dtlab.course import pidns, sandbox


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
