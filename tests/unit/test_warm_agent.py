"""The warm agent server's pure parts: which environments share a server, the opt-out's check, an agent ended by its own
request. The forks themselves (an agent's command line, a rank that imports nothing):
tests/integration/test_warm_agent_forks.py."""

import os
import subprocess

import pytest

import dtlab
from dtlab.launching import warm


def test_the_ranks_own_variables_and_pytests_do_not_split_servers_but_anything_else_does():
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    key = warm.server_key(base)
    assert warm.server_key({**base, "DTLAB_FAULT": "1:3:kill", "PYTEST_CURRENT_TEST": "t (call)"}) == key
    for name, value in (("OMP_NUM_THREADS", "2"), ("PYTHONHASHSEED", "1"), ("HF_HUB_OFFLINE", "1")):
        assert warm.server_key({**base, name: value}) != key, name


def test_an_edited_dtlab_gets_a_fresh_server(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(warm, "_PKG_DIR", str(tmp_path))
    before = warm.server_key({})
    os.utime(tmp_path / "a.py", ns=(0, os.stat(tmp_path / "a.py").st_mtime_ns + 10**9))
    assert warm.server_key({}) != before
    (tmp_path / "b.py").write_text("")
    assert warm.server_key({}) != before


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_a_warm_agent_setting_other_than_0_or_1_is_refused_before_anything_starts(tmp_path, monkeypatch, value):
    monkeypatch.setenv("DTLAB_WARM_AGENT", value)
    with pytest.raises(ValueError, match=rf"DTLAB_WARM_AGENT must be 0 or 1, got {value!r}"):
        dtlab.launch(dtlab.tiny(out=str(tmp_path / "never")))
    assert not (tmp_path / "never").exists()
    assert warm.enabled({}) and warm.enabled({"DTLAB_WARM_AGENT": "1"}) and not warm.enabled({"DTLAB_WARM_AGENT": "0"})


class _FakeServer:
    """What WarmProc reads of its server: the exit statuses by request, the lock, whether it still answers."""

    def __init__(self, exits):
        import threading

        self.cond, self.exits, self.dead = threading.Condition(), exits, False


def test_an_agent_ends_by_its_own_request_not_by_an_earlier_agent_with_the_same_pid():
    """pids wrap around in a long notebook session: an ended agent's status must not end a later one."""
    server = _FakeServer({1: 0})
    earlier, later = warm.WarmProc(server, 1, 4242, []), warm.WarmProc(server, 2, 4242, [])
    assert earlier.poll() == 0 and later.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        later.wait(timeout=0.05)
    server.exits[2] = -9
    assert later.wait(timeout=1) == -9 and later.returncode == -9 and not server.exits
