"""The grading sandbox's choice and limits, without starting one (the drills that start one are
tests/e2e/test_sandbox_drills.py): auto takes the strongest mechanism that works, an unavailable one asked for by
name is refused, and with none available `dtlab grade` refuses to run submissions unless given --sandbox none."""

import json
import os
import zipfile

import pytest

from dtlab.cli.doctor import sandbox_line
from dtlab.cli.main import main
from dtlab.course import limits, sandbox


def _only(monkeypatch, works=()):
    monkeypatch.setattr(sandbox, "probe", lambda m: None if m in works else f"{m} is not here")


def test_auto_takes_the_strongest_that_works(monkeypatch):
    _only(monkeypatch, ("bwrap", "namespaces"))
    assert sandbox.choose("auto") == "bwrap"
    _only(monkeypatch, ("namespaces",))
    assert sandbox.choose("auto") == "namespaces"
    assert sandbox.choose("none") == "none"
    with pytest.raises(ValueError, match="--sandbox bwrap: bwrap is not here"):
        sandbox.choose("bwrap")
    with pytest.raises(ValueError, match="one of"):
        sandbox.choose("chroot")


def test_with_no_sandbox_grade_refuses_unless_told_none(monkeypatch, tmp_path, capsys):
    _only(monkeypatch)
    with pytest.raises(ValueError, match="pass --sandbox none"):
        sandbox.choose("auto")
    zipfile.ZipFile(tmp_path / "01_ddp_breakdown.zip", "w").close()
    nb = tmp_path / "alice_lab01.ipynb"
    nb.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert main(["grade", str(tmp_path / "01_ddp_breakdown.zip"), str(nb), "--csv", str(tmp_path / "s.csv")]) == 2
    err = capsys.readouterr().err
    assert "no sandbox is available" in err and "apt-get install -y bubblewrap" in err
    assert not (tmp_path / "s.csv").exists()  # nothing ran


def test_sizes_and_the_limits_named():
    assert limits.parse_size("4G") == limits.parse_size("4GiB") == 4 * 2**30
    assert limits.parse_size("512M") == 512 * 2**20 and limits.parse_size(1000) == 1000
    with pytest.raises(ValueError, match="not a size"):
        limits.parse_size("lots")
    lim = limits.Limits(memory=4 * 2**30, disk=128 * 2**20)
    assert limits.limit_hit("MemoryError: (cell 2)", lim) == "memory limit 4 GiB exceeded"
    assert limits.limit_hit("OSError: [Errno 28] No space left on device", lim) == "scratch disk limit 128 MiB exceeded"
    assert limits.limit_hit("NameError: x (cell 1)", lim) is None
    fork = 'File "/usr/lib/python3.11/os.py", in fork\nBlockingIOError: [Errno 11] Resource temporarily unavailable'
    assert limits.limit_hit(fork, lim) == "process limit exceeded"
    assert limits.limit_hit("RuntimeError: can't start new thread", lim) == "process limit exceeded"
    # a non-blocking socket raises the same error text as a refused fork; it is not a limit
    sock = "sock.recv(4)\nBlockingIOError: [Errno 11] Resource temporarily unavailable"
    assert limits.limit_hit(sock, lim) is None


def test_the_sandbox_sees_the_environment_read_only_and_nothing_of_home():
    ro, _ = sandbox.ro_paths()
    assert "/usr" in ro and not any(p in ("/", "/home", "/root", "/tmp") for p in ro)
    cmd = sandbox.command("bwrap", ["true"], "/x/in", "/x/out", uid=2_000_000_123)
    if os.geteuid() == 0:  # no user namespace: the sandbox drops to a uid of its own, with no capabilities
        assert cmd[cmd.index("--") + 1 : cmd.index("--") + 3] == ["setpriv", "--reuid=2000000123"]
        assert "--no-new-privs" in cmd and "--bounding-set=-all" in cmd and "--unshare-net" in cmd
    else:
        assert cmd[cmd.index("--uid") + 1] == "65534" and "--unshare-all" in cmd
    assert "--die-with-parent" in cmd
    assert cmd[cmd.index("--bind") + 1 : cmd.index("--bind") + 3] == ["/x/out", sandbox.OUT]
    assert "--remount-ro" in cmd


def test_doctor_names_the_sandbox():
    assert "bwrap" in sandbox_line({"bwrap": None, "namespaces": None})
    assert "namespaces (unavailable: bwrap: not installed)" in sandbox_line(
        {"bwrap": "not installed", "namespaces": None}
    )
    assert "NONE" in sandbox_line({"bwrap": "no", "namespaces": "no"})


def test_a_refused_fork_is_told_from_a_busy_socket_by_where_it_was_raised():
    import nbformat

    from dtlab.course import grader

    def failing(ename, evalue, frames):
        tb = [f"File \x1b[0;32m/usr/lib/x.py:1\x1b[0m, in \x1b[0;36m{f}\x1b[0;34m(self)\x1b[0m" for f in frames]
        out = nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=["Cell In[1], line 1", *tb])
        return nbformat.v4.new_code_cell("...", outputs=[out])

    eagain = "[Errno 11] Resource temporarily unavailable"
    nb = nbformat.v4.new_notebook(
        cells=[
            failing("BlockingIOError", eagain, ["Popen.__init__", "Popen._execute_child"]),
            failing("BlockingIOError", eagain, ["socket.recv"]),
            failing("NameError", "name 'x' is not defined", []),
        ]
    )
    fork, sock, name = grader._errors(nb)
    assert fork.endswith("(raised in Popen._execute_child) (cell 1)") and sock.endswith("(cell 2)")
    assert name == "NameError: name 'x' is not defined (cell 3)"
    lim = limits.Limits(memory=4 * 2**30, disk=128 * 2**20)
    assert limits.limit_hit(fork, lim) == "process limit exceeded"
    assert limits.limit_hit(sock, lim) is None
